"""The CPU bf16 GEMV (`csrc/bf16_gemv.c`): fp32 activations times a bf16 weight, for the
lm_head of quantized models (`quantkit.runtime.head.CastHead`). Built on first use where the CPU has
AVX512-BF16; elsewhere `bf16_gemv_available()` is False and the caller keeps torch."""

from __future__ import annotations

import ctypes
import functools

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels import cpu_abi

__all__ = ["bf16_gemv", "bf16_gemv_available"]


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = cpu_abi.load("qk_bf16_gemv")  # typed by `cpu_abi`
    except KernelUnavailableError:
        return None
    return lib if lib.qk_bf16_gemv_available() else None


def bf16_gemv_available() -> bool:
    """True if the kernel builds here and the CPU has AVX512-BF16."""
    return _library() is not None


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N] = x.to(bf16) [M, K] @ weight.T (weight bf16 [N, K]), summed in fp32.

    x: fp32 [M, K] with contiguous rows; weight: bf16 [N, K] with contiguous rows."""
    lib = _library()
    if lib is None:
        raise KernelUnavailableError("bf16 GEMV: expected a CPU with AVX512-BF16, got none")
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or not x.is_cpu:
        raise ValueError(
            f"x: expected fp32 [M, K] on the CPU with contiguous rows, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(
            f"weight: expected bf16 [N, K] with contiguous rows, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected {k} columns (x has {k}), got {weight.shape[1]}")
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    status = lib.qk_bf16_gemv(
        x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), y.data_ptr(),
        n, torch.get_num_threads(),
    )  # fmt: skip
    if status == 2:
        raise MemoryError("bf16 GEMV: could not allocate the bf16 copy of x")
    if status:
        raise KernelUnavailableError(f"bf16 GEMV: expected status 0, got {status}")
    return y
