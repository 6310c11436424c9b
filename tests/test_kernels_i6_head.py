"""The 6-bit lm_head (`--head-dtype int6`): the weight rounded to 6-bit codes with an fp16
scale per row and group of 32 when the model loads, and the VNNI GEMV that multiplies int8
activations by them."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.fused_kernels.cpu.i6_gemv import I6Weight, i6_gemv, i6_gemv_available, round_i6
from quantkit.runtime.head import Int6Head, head_name
from tests.conftest import make_hf_model

needs_vnni = pytest.mark.skipif(not i6_gemv_available(), reason="the 6-bit GEMV needs AVX512-VNNI")


def test_rounding_keeps_each_group_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.linspace(0.01, 5, 40)[:, None]
    w[3, 32:64] = 0.0  # an all-zero group: scale 0, codes 0
    codes, scales = round_i6(w)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert int(codes.abs().max()) <= 31 and scales.shape == (40, 3)
    step = scales.float().repeat_interleave(32, dim=1)
    back = codes.float() * step
    assert ((back - w).abs() <= step / 2 * (1 + 1e-3) + 1e-30).all()
    assert torch.equal(codes[3, 32:64], torch.zeros(32, dtype=torch.int8))
    assert float(scales[3, 1]) == 0.0
    # the largest value of each group reaches code 31 (the fp16 scale rounds either way)
    assert (codes.abs().view(40, 3, 32).amax(-1)[w.view(40, 3, 32).abs().amax(-1) > 0] >= 30).all()
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        round_i6(torch.randn(4, 40))


def test_the_layout_is_six_bits_a_weight_and_a_scale_per_32() -> None:
    weight = torch.randn(37, 64)
    packed = I6Weight(weight)  # 37 rows: 3 tiles, the last padded
    assert packed.packed.shape == (3, 2, 2, 3, 16, 4)  # tile, group, quad, vector, row, element
    assert packed.nbytes() == 3 * 2 * 384 + 3 * 2 * 16 * 2
    want_codes, want_scales = round_i6(weight)
    codes = packed.codes()
    assert torch.equal(codes, want_codes) and torch.equal(packed.row_scales(), want_scales)
    # row 16 * 1 + 5, element 32 * 1 + 16 * 1 + 4 * 2 + 3 (group 1, quad 1, word 2, byte 3)
    u = int(codes[21, 59]) + 32
    a, b, c = packed.packed[1, 1, 1]  # the quad's three 64-byte vectors, as [row][element]
    assert int(b[5, 3]) & 15 == u & 15  # words 2 and 3: the low nibbles of vector b
    assert (int(c[5, 3]) >> 4) & 3 == u >> 4  # word 2's top bits: bits 4-5 of vector c
    assert int(a[5, 3]) == (int(codes[21, 48 + 3]) + 32) & 15 | (
        ((int(codes[21, 52 + 3]) + 32) & 15) << 4
    )


def test_a_weight_taller_than_one_rounding_chunk_packs_every_row() -> None:
    from quantkit.fused_kernels.cpu import i6_gemv as module

    weight = torch.randn(module._ROWS + 21, 32)  # a second chunk of 21 rows, its tile padded
    packed = I6Weight(weight)
    codes, scales = round_i6(weight)
    assert torch.equal(packed.codes(), codes) and torch.equal(packed.row_scales(), scales)


def _reference(x: torch.Tensor, packed: I6Weight) -> torch.Tensor:
    """fp64 y of x quantized per block of 32 (t = absmax / 127, q = round(x / t)) and the
    stored codes and scales: what the kernel sums in integers, then scales."""
    m, k = x.shape
    b = x.view(m, k // 32, 32)
    t = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(t > 0, 1 / t, torch.zeros_like(t))).clamp(-127, 127)
    codes = packed.codes().double().view(packed.out_features, k // 32, 32)
    sums = torch.einsum("mgk,ngk->mng", q.double(), codes)
    return (sums * t.double().squeeze(-1)[:, None, :] * packed.row_scales().double()[None]).sum(-1)


@needs_vnni
@pytest.mark.parametrize(
    ("m", "n", "k"),
    # 1 row; 8 + 1 rows with a padded tile; one group; 16 rows (two chunks of 8), a wide K
    [(1, 64, 576), (9, 130, 64), (3, 77, 32), (16, 200, 2048)],
)
def test_the_gemv_multiplies_the_rounded_operands(m: int, n: int, k: int) -> None:
    """Equal to an fp64 product of the same operands within fp32 summation, a row's result
    the same bits alone or among others, and close to the unrounded product."""
    g = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 3] = 40.0  # an outlier: its block gets a coarser step
    w = torch.randn(n, k, generator=g) * 0.05
    w[1, :32] = 0.0  # a zero group
    packed = I6Weight(w)
    y = i6_gemv(x, packed)
    ref = _reference(x, packed)
    magnitude = (x.double().abs() @ w.double().abs().T).max().item()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * magnitude)
    alone = torch.cat([i6_gemv(x[i : i + 1], packed) for i in range(m)])
    assert torch.equal(y, alone)
    exact = x.double() @ w.double().T
    assert (y.double() - exact).abs().max() < 0.05 * magnitude


@needs_vnni
def test_the_gemv_rejects_what_it_cannot_take() -> None:
    packed = I6Weight(torch.randn(10, 64))
    with pytest.raises(ValueError, match="expected 1 to 16 rows of 64"):
        i6_gemv(torch.randn(17, 64), packed)
    with pytest.raises(ValueError, match="expected 1 to 16 rows of 64"):
        i6_gemv(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="out: expected fp32 \\[2, 10\\]"):
        i6_gemv(torch.randn(2, 64), packed, out=torch.empty(2, 11))


@needs_vnni
def test_the_head_takes_any_row_count_in_calls_of_16() -> None:
    head = Int6Head(torch.randn(300, 64))
    x = torch.randn(2, 20, 64)
    y = head(x)
    assert y.shape == (2, 20, 300) and y.dtype == torch.float32
    rows = x.reshape(40, 64)
    want = torch.cat([i6_gemv(rows[r : r + 16], head.packed) for r in range(0, 40, 16)])
    assert torch.equal(y.reshape(40, 300), want)
    assert torch.equal(head(x[1, 7]), want[27])  # one row alone: the same bits


@needs_vnni
def test_int6_head_through_the_loader_generate_and_roofline(tiny_llama_dir) -> None:
    from quantkit.perf.roofline import model_read_bytes
    from quantkit.runtime.generate import generate
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions
    from quantkit.runtime.sampling import SamplingParams

    dense = load_model(tiny_llama_dir, tokenizer=False, options=RuntimeOptions()).model
    model = load_model(tiny_llama_dir, tokenizer=False, options=RuntimeOptions(head_dtype="int6"))
    model = model.model
    assert isinstance(model.lm_head, Int6Head) and head_name(model) == "int6 g32"
    assert model_read_bytes(model).lm_head == model.lm_head.weight_bytes()
    ids = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        a, b = dense(ids).float(), model(ids).float()
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert not torch.equal(a, b)
    out = generate(model, [[5, 17, 99]], SamplingParams(max_new_tokens=4))
    assert len(out.tokens[0]) == 4


def test_int6_is_named_and_other_names_are_refused() -> None:
    from quantkit.runtime.options import RuntimeOptions

    assert RuntimeOptions(head_dtype="int6").head_dtype == "int6"
    with pytest.raises(Exception, match="int5"):
        RuntimeOptions(head_dtype="int5")


def test_a_width_that_is_not_a_multiple_of_32_is_one_clear_error(tmp_path) -> None:
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions

    path = make_hf_model(tmp_path / "m", {"hidden_size": 48, "num_attention_heads": 3,
                                          "num_key_value_heads": 1})  # fmt: skip
    want = "expected a hidden size that is a multiple of 32, got 48"
    if not i6_gemv_available():
        want = "expected a CPU with AVX512-VNNI"
    with pytest.raises(GenerationError, match=want):
        load_model(path, tokenizer=False, options=RuntimeOptions(head_dtype="int6"))
