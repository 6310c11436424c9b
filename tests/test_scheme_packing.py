"""L0: QuantScheme validation and the packing math (exact for integer paths)."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import SchemeError
from quantkit.format.packing import (
    fake_quantize_int4,
    int4_dequantize,
    int4_qparams,
    int4_quantize,
    pack_int4,
    pack_zero_points,
    quantize_fp8,
    quantize_fp8_per_token,
    unpack_int4,
    unpack_zero_points,
)
from quantkit.format.scheme import QuantScheme

SMOLLM_LAYERS = [("model.layers.0.self_attn.q_proj", 576), ("model.layers.0.mlp.down_proj", 1536)]


def test_auto_group_size_picks_largest_divisor() -> None:
    assert QuantScheme().resolve(SMOLLM_LAYERS).group_size == 64
    assert QuantScheme().resolve([("a", 4096), ("b", 14336)]).group_size == 128
    assert QuantScheme("int4", 32).resolve(SMOLLM_LAYERS).group_size == 32


def test_explicit_group_size_must_divide_every_layer() -> None:
    with pytest.raises(
        SchemeError,
        match="group_size 128 does not divide in_features 576 of model.layers.0.self_attn.q_proj",
    ):
        QuantScheme("int4", 128).resolve(SMOLLM_LAYERS)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"kind": "int3"}, "kind: expected one of int4, fp8, int8, nvfp4, mxfp4, got 'int3'"),
        ({"kind": "gptq"}, "kind: expected one of int4, fp8, int8, nvfp4, mxfp4, got 'gptq'"),
        ({"group_size": 48}, "group_size: expected auto, 32, 64, 128 or -1"),
        ({"kind": "fp8", "group_size": 64}, "fp8 uses one scale per output channel"),
        ({"activations": "dynamic"}, "int4 is weight-only (W4A16"),
        ({"kind": "fp8", "activations": "static"}, "activations: expected 'none' or 'dynamic'"),
    ],
)
def test_scheme_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(SchemeError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        QuantScheme(**kwargs)


def test_scheme_describe() -> None:
    assert QuantScheme("int4", 64).describe() == "int4 g64 asymmetric"
    assert QuantScheme("int4", 64).describe("awq") == "awq int4 g64 asymmetric"
    assert QuantScheme("int4", -1, True).describe("rtn") == "rtn int4 per-channel symmetric"
    assert QuantScheme("fp8").describe() == "fp8 e4m3 per-channel (W8A16)"
    assert QuantScheme("fp8").bits == 8 and QuantScheme("int4").bits == 4


@pytest.mark.parametrize(
    "group,k,expected", [(32, 576, 32), (64, 576, 64), (-1, 576, 576), (-1, 123, 123)]
)
def test_group_size_for_is_the_one_rule(group: int, k: int, expected: int) -> None:
    scheme = QuantScheme("int4", group)
    assert scheme.group_size_for(k) == expected and scheme.groups(k) == k // expected
    with pytest.raises(SchemeError, match="still 'auto'"):
        QuantScheme("int4").group_size_for(k)


def test_scheme_json_round_trip() -> None:
    for scheme in (QuantScheme("int4", 64, True), QuantScheme("fp8", activations="dynamic")):
        assert QuantScheme.from_json(scheme.to_json()) == scheme


@pytest.mark.parametrize("n,k", [(1, 8), (5, 123), (37, 200), (64, 576)])
def test_pack_unpack_round_trip_exact(n: int, k: int) -> None:
    codes = torch.randint(
        -8, 8, (n, k), generator=torch.Generator().manual_seed(n * k), dtype=torch.int8
    )
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (n, (k + 7) // 8)
    assert torch.equal(unpack_int4(packed, k), codes)
    zero = torch.randint(-8, 8, (n, 3), dtype=torch.int32)
    zp = pack_zero_points(zero)
    assert zp.shape == ((n + 7) // 8, 3)
    assert torch.equal(unpack_zero_points(zp, n), zero)


def test_pack_hand_example() -> None:
    # Nibbles are code + 8, lowest first: codes 0..7 -> nibbles 8..15 -> 0xFEDCBA98.
    word = pack_int4(torch.arange(8, dtype=torch.int8).view(1, 8))
    assert word.item() == 0xFEDCBA98 - 2**32  # stored as the int32 with that bit pattern
    # Zero points pack down the rows: rows 0..7 of one group -> one word.
    zp = pack_zero_points(torch.tensor([[-8], [-7], [0], [7], [0], [0], [0], [0]]))
    assert zp.item() == 0x8888F810 - 2**32


def test_asymmetric_quantization_hand_example() -> None:
    w = torch.tensor([[-1.0, 0.0, 1.0, 2.0, -0.3, 1.2, 0.6, 0.0]])
    scale, zero = int4_qparams(w, group_size=4, symmetric=False)
    torch.testing.assert_close(scale, torch.tensor([[0.2, 0.1]]))
    assert zero.tolist() == [[-3, -5]]  # round(1 / 0.2) - 8 = -3; round(0.3 / 0.1) - 8 = -5
    codes = int4_quantize(w, scale, zero, group_size=4)
    assert codes.tolist() == [[-8, -3, 2, 7, -8, 7, 1, -5]]
    back = int4_dequantize(codes, scale, zero, group_size=4)
    assert float((back - w).abs().max()) <= float(scale.max()) / 2 + 1e-6


def test_symmetric_keeps_the_largest_weight_exact() -> None:
    w = torch.tensor([[0.7, -0.1, 0.3, -0.33]])
    fq = fake_quantize_int4(w, group_size=4, symmetric=True)
    assert float(fq[0, 0]) == pytest.approx(0.7)
    assert float(fq[0, 3]) == pytest.approx(-0.3)  # scale 0.1: -3.3 -> -3


def test_int4_error_is_small_relative_to_the_weights() -> None:
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    for g, bound in [(32, 0.09), (64, 0.10), (-1, 0.14)]:
        err = (fake_quantize_int4(w, group_size=g, symmetric=False) - w).norm() / w.norm()
        assert err < bound, (g, float(err))


def test_fp8_per_channel_and_per_token() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    w8, scale = quantize_fp8(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (16, 1)
    assert torch.equal(w8.float().abs().amax(dim=1), torch.full((16,), 448.0))
    assert float((w8.float() * scale - w).norm() / w.norm()) < 0.03
    x8, xs = quantize_fp8_per_token(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]))
    assert xs[0].item() == pytest.approx(2.0 / 448)
    assert x8[0].float().tolist() == [224.0, -448.0, 112.0]
    assert x8[1].float().tolist() == [0.0, 0.0, 0.0]


def test_int8_absmax_in_blocks_of_rows_equals_the_whole_matrix(monkeypatch) -> None:
    """A large matrix is rounded a block of rows at a time (bounded temporaries): the same
    codes and scales, bit for bit, including an all-zero row and a 3-D input."""
    from quantkit.format import packing

    x = torch.randn(37, 24, generator=torch.Generator().manual_seed(0)) * 3
    x[5] = 0
    whole = packing.int8_absmax(x)
    monkeypatch.setattr(packing, "INT8_BLOCK_ELEMENTS", 24 * 4)  # 4 rows a block, 10 blocks
    for got, want in zip(packing.int8_absmax(x), whole, strict=True):
        assert torch.equal(got, want)
    codes, scale = packing.int8_absmax(x.view(37, 2, 12))
    assert codes.shape == (37, 2, 12) and scale.shape == (37, 2, 1)


def test_interleave16_in_chunks_equals_one_pass() -> None:
    from quantkit.fused_kernels.cpu.launch import interleave16

    t = torch.arange(53 * 5, dtype=torch.int32).view(53, 5)
    pad = torch.cat([t, t.new_full((11, 5), -1)])
    want = pad.view(-1, 16, 5).transpose(1, 2).contiguous()
    for tiles in (1, 2, 4, 100):
        assert torch.equal(interleave16(t, fill=-1, tiles_at_once=tiles), want), tiles
