"""The int8 lm_head (`--head-dtype int8`): rows rounded to int8 with a scale each when the model
loads, and the CPU GEMV that multiplies fp32 activations by them."""

from __future__ import annotations

import pytest
import torch

from quantkit.fused_kernels.cpu.bf16_gemv import (
    I8I8Weight,
    i8_gemv,
    i8_gemv_available,
    i8i8_gemv,
    i8i8_gemv_available,
)
from quantkit.runtime.head import HEAD_GEMV_MAX_M, CastHead

needs_gemv = pytest.mark.skipif(not i8_gemv_available(), reason="the int8 GEMV needs AVX-512")
needs_vnni = pytest.mark.skipif(
    not i8i8_gemv_available(), reason="the int8 x int8 GEMV needs AVX512-VNNI"
)


def test_int8_head_rounds_each_row_within_half_a_step() -> None:
    weight = torch.randn(300, 64) * torch.linspace(0.1, 10, 300)[:, None]
    weight[7] = 0.0  # an all-zero row: scale 0, codes 0
    head = CastHead(weight, torch.int8)
    assert head.weight.dtype == torch.int8 and head.scale is not None
    back = head.weight.float() * head.scale[:, None]
    step = weight.abs().amax(-1, keepdim=True) / 127
    assert ((back - weight).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[7], torch.zeros(64))
    assert head.weight_bytes() == 300 * 64 + 300 * 4


@needs_gemv
@pytest.mark.parametrize(
    ("m", "n", "k"),
    # 1 row; 8 + 8 + 4 rows; an odd weight row count; K not a multiple of 64 or 16 (tails)
    [(1, 64, 576), (20, 130, 64), (3, 77, 100), (8, 200, 33), (9, 1, 576)],
)
def test_int8_gemv_multiplies_the_stored_operands_in_fp32(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) + 0.01
    y = i8_gemv(x, w, scale)
    ref = x.double() @ (w.double() * scale.double()[:, None]).T
    magnitude = (x.double().abs() @ (w.double().abs() * scale.double()[:, None]).T).max().item()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * magnitude)


@needs_gemv
def test_int8_gemv_rejects_bad_operands() -> None:
    w = torch.zeros(10, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight: expected int8"):
        i8_gemv(torch.randn(2, 16), w.float(), torch.ones(10))
    with pytest.raises(ValueError, match="scale: expected 10 contiguous fp32"):
        i8_gemv(torch.randn(2, 16), w, torch.ones(9))


@needs_gemv
def test_int8_head_takes_the_gemv_for_few_rows_and_the_blas_for_many() -> None:
    head = CastHead(torch.randn(300, 64), torch.int8)
    assert head.scale is not None
    few = torch.randn(2, 3, 64)
    if head._i8i8 is not None:  # a VNNI CPU: the activations in int8 too
        want = i8i8_gemv(few.reshape(6, 64), head._i8i8).view(2, 3, 300)
    else:
        want = i8_gemv(few.reshape(6, 64), head.weight, head.scale).view(2, 3, 300)
    assert torch.equal(head(few), want)
    many = torch.randn(HEAD_GEMV_MAX_M + 1, 64)
    torch.testing.assert_close(head(many), i8_gemv(many, head.weight, head.scale))


def test_int8_head_through_the_loader_generate_and_roofline(tiny_llama_dir) -> None:
    from quantkit.perf.roofline import model_read_bytes
    from quantkit.runtime.generate import generate
    from quantkit.runtime.head import head_name
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions
    from quantkit.runtime.sampling import SamplingParams

    model = load_model(tiny_llama_dir, tokenizer=False, options=RuntimeOptions(head_dtype="int8"))
    model = model.model
    assert head_name(model) == "int8"
    assert model_read_bytes(model).lm_head == model.lm_head.weight_bytes()
    out = generate(model, [[5, 17, 99]], SamplingParams(max_new_tokens=4))
    assert len(out.tokens[0]) == 4


def _blocks_rounded(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the int8 x int8 GEMV sees it: each row's blocks quantized on their own
    (t = absmax / 127, q = round(x / t) to nearest even), then t * q."""
    m, k = x.shape
    b = x.view(m, k // block, block)
    t = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(t > 0, 1 / t, torch.zeros_like(t))).clamp(-127, 127)
    return (q * t).view(m, k)


@needs_vnni
@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    # 1 row; 8 + 1 rows with a padded tile; blocks of 32 and 128; 16 rows (two chunks of 8)
    [(1, 64, 576, 64), (9, 130, 64, 64), (3, 77, 96, 32), (16, 200, 128, 128)],
)
def test_int8_int8_gemv_multiplies_the_quantized_rows(m: int, n: int, k: int, block: int) -> None:
    """The VNNI head: x quantized per block, W8 + 128 interleaved by 16 rows, integer products;
    equal to an fp64 product of the same operands within fp32 summation, a row's result the
    same bits alone or among others, and measurably unlike fp32 activations."""
    g = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 3] = 40.0  # an outlier: its block gets a coarser step
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) + 0.01
    packed = I8I8Weight(w, scale)
    assert packed.block == block
    y = i8i8_gemv(x, packed)
    ref = _blocks_rounded(x, block).double() @ (w.double() * scale.double()[:, None]).T
    magnitude = (x.double().abs() @ (w.double().abs() * scale.double()[:, None]).T).max().item()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * magnitude)
    alone = torch.cat([i8i8_gemv(x[i : i + 1], packed) for i in range(m)])
    assert torch.equal(y, alone)
    assert (y - i8_gemv(x, w, scale)).abs().max() > 1e-6 * magnitude


@needs_vnni
def test_int8_int8_gemv_rejects_what_it_cannot_take() -> None:
    packed = I8I8Weight(torch.zeros(10, 64, dtype=torch.int8), torch.ones(10))
    with pytest.raises(ValueError, match="expected 1 to 16 rows of 64"):
        i8i8_gemv(torch.randn(17, 64), packed)
    assert I8I8Weight(torch.zeros(10, 40, dtype=torch.int8), torch.ones(10)).block == 0
    assert CastHead(torch.randn(30, 40), torch.int8)._i8i8 is None  # K = 40: fp32 activations
