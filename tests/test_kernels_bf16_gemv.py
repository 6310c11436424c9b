"""The CPU bf16 GEMV behind a quantized model's bf16 lm_head: bf16(x) @ W.T summed in fp32."""

from __future__ import annotations

import pytest
import torch

from quantkit.fused_kernels.cpu.bf16_gemv import bf16_gemv, bf16_gemv_available
from quantkit.runtime.head import HEAD_GEMV_MAX_M, CastHead

pytestmark = pytest.mark.skipif(
    not bf16_gemv_available(), reason="the bf16 GEMV needs a CPU with AVX512-BF16"
)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    # 1 row; 8 + 8 + 4 rows; an odd weight row count; K not a multiple of 32 (masked tail)
    [(1, 64, 576), (20, 130, 64), (3, 77, 100), (8, 200, 33), (9, 1, 576)],
)
def test_bf16_gemv_sums_bf16_operands_in_fp32(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    y = bf16_gemv(x, w)
    ref = x.bfloat16().double() @ w.double().T  # the exact sums of the same products
    magnitude = (x.bfloat16().double().abs() @ w.double().abs().T).max().item()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * magnitude)


def test_bf16_gemv_takes_strided_rows() -> None:
    base = torch.randn(4, 200)
    x = base[:, 8:136]  # rows 200 apart, each contiguous
    w = torch.randn(10, 128).bfloat16()
    torch.testing.assert_close(bf16_gemv(x, w), bf16_gemv(x.contiguous(), w))


def test_bf16_gemv_rejects_bad_operands() -> None:
    w = torch.randn(10, 16).bfloat16()
    with pytest.raises(ValueError, match="x: expected fp32"):
        bf16_gemv(torch.randn(2, 16).double(), w)
    with pytest.raises(ValueError, match="weight: expected bf16"):
        bf16_gemv(torch.randn(2, 16), w.float())
    with pytest.raises(ValueError, match="expected 16 columns"):
        bf16_gemv(torch.randn(2, 16), torch.randn(10, 12).bfloat16())


def test_cast_head_takes_the_gemv_for_few_rows_and_the_blas_for_many() -> None:
    """Up to HEAD_GEMV_MAX_M rows: the C GEMV, bit for bit (fp32 logits); more: oneDNN, which
    rounds its output to bf16, so it agrees within a bf16 ulp of the logits."""
    weight = torch.randn(300, 64)
    head = CastHead(weight, torch.bfloat16)
    few = torch.randn(2, 3, 64)  # 6 rows
    assert torch.equal(head(few), bf16_gemv(few.reshape(6, 64), head.weight).view(2, 3, 300))
    many = torch.randn(HEAD_GEMV_MAX_M + 1, 64)
    got = head(many)
    assert got.dtype == torch.bfloat16
    want = bf16_gemv(many, head.weight)
    torch.testing.assert_close(got.float(), want, rtol=2.0**-7, atol=1e-3)
