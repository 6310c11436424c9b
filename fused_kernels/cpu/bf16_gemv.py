"""The CPU head GEMVs (`csrc/bf16_gemv.c`): fp32 activations times a bf16 weight, or times an
int8 weight with a scale per row, for the lm_head of quantized models
(`quantkit.runtime.head.CastHead`). Built on first use; the bf16 one where the CPU has
AVX512-BF16, the int8 one with AVX-512F; elsewhere `bf16_gemv_available()` /
`i8_gemv_available()` are False and the caller keeps torch."""

from __future__ import annotations

import ctypes
import functools

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.cpu import abi as cpu_abi
from quantkit.fused_kernels.cpu.launch import best_pointer, int8_block, interleave16

__all__ = [
    "I8I8Weight",
    "bf16_gemv",
    "bf16_gemv_available",
    "i8_gemv",
    "i8_gemv_available",
    "i8i8_gemv",
    "i8i8_gemv_available",
]

# Rows one `qk_i8i8_gemv` call takes.
I8I8_MAX_M = 16


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        return cpu_abi.load("qk_bf16_gemv")  # typed by `abi`
    except KernelUnavailableError:
        return None


def bf16_gemv_available() -> bool:
    """True if the kernel builds here and the CPU has AVX512-BF16."""
    lib = _library()
    return lib is not None and bool(lib.qk_bf16_gemv_available())


def i8_gemv_available() -> bool:
    """True if the int8 kernel builds here (an AVX-512 CPU)."""
    lib = _library()
    return lib is not None and bool(lib.qk_i8_gemv_available())


def i8i8_gemv_available() -> bool:
    """True if the int8 x int8 kernel builds here (a CPU with AVX512-VNNI)."""
    lib = _library()
    return lib is not None and bool(lib.qk_i8i8_gemv_available())


class I8I8Weight:
    """An int8 weight [N, K] with a scale per row, laid out for `qk_i8i8_gemv`: W8 + 128 as
    uint8 with 16 rows interleaved (lane l of word j: row 16 t + l's elements 4j..4j+3), the
    scales padded to whole tiles, and the activation block (the largest of 128, 64, 32
    dividing K). `block` is 0 where none divides K: the kernel does not apply."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.block = int8_block(k, k)
        if not self.block:
            return
        u8 = torch.empty(n, k, dtype=torch.uint8)
        for r in range(0, n, 16384):  # through int16 a block of rows at a time
            u8[r : r + 16384] = (weight[r : r + 16384].to(torch.int16) + 128).to(torch.uint8)
        self.words = interleave16(u8.view(torch.int32))  # rows past N: computed, never stored
        pad = -n % 16
        self.scale = torch.cat([scale.float(), scale.new_zeros(pad, dtype=torch.float32)])

    def nbytes(self) -> int:
        return 0 if not self.block else self.words.numel() * 4 + self.scale.numel() * 4


def i8i8_gemv(
    x: torch.Tensor, weight: I8I8Weight, *, best: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [M, N] = q(x) [M, K] @ (W8 * scale[:, None]).T: x (fp32 [M, K], contiguous rows,
    M <= `I8I8_MAX_M`) quantized to int8 per `weight.block` elements, multiplied in
    integers (`qk_i8i8_gemv`). best: int64 [M, QK_TOP], set to each row's best columns of the
    result as the kernel stored it, in arg-max order (larger first, the first of equal values;
    -1 after the last finite one, and a whole row -1 where it holds a NaN)."""
    if not i8i8_gemv_available():
        raise KernelUnavailableError("int8 x int8 GEMV: expected a CPU with AVX512-VNNI, got none")
    lib = _library()
    assert lib is not None
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or not x.is_cpu:
        raise ValueError(
            f"x: expected fp32 [M, K] on the CPU with contiguous rows, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    if k != weight.in_features or not weight.block or not 1 <= m <= I8I8_MAX_M:
        raise ValueError(
            f"x: expected 1 to {I8I8_MAX_M} rows of {weight.in_features} (a multiple of 32), "
            f"got {tuple(x.shape)}"
        )
    n = weight.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    status = lib.qk_i8i8_gemv(
        x.data_ptr(), m, k, x.stride(0), weight.words.data_ptr(), weight.scale.data_ptr(), n,
        weight.block, y.data_ptr(), n, torch.get_num_threads(), best_pointer(best, m),
    )  # fmt: skip
    _status(status, "int8 x int8 GEMV")
    return y


def _check(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, int]:
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or not x.is_cpu:
        raise ValueError(
            f"x: expected fp32 [M, K] on the CPU with contiguous rows, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if weight.dtype != dtype or weight.dim() != 2 or weight.stride(-1) != 1:
        name = {torch.bfloat16: "bf16", torch.int8: "int8"}[dtype]
        raise ValueError(
            f"weight: expected {name} [N, K] with contiguous rows, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected {k} columns (x has {k}), got {weight.shape[1]}")
    return m, k, n


def _status(status: int, what: str) -> None:
    if status == 2:
        raise MemoryError(f"{what}: could not allocate the bf16 copy of x")
    if status:
        raise KernelUnavailableError(f"{what}: expected status 0, got {status}")


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N] = x.to(bf16) [M, K] @ weight.T (weight bf16 [N, K]), summed in fp32.

    x: fp32 [M, K] with contiguous rows; weight: bf16 [N, K] with contiguous rows."""
    if not bf16_gemv_available():
        raise KernelUnavailableError("bf16 GEMV: expected a CPU with AVX512-BF16, got none")
    lib = _library()
    assert lib is not None
    m, k, n = _check(x, weight, torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    status = lib.qk_bf16_gemv(
        x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), y.data_ptr(),
        n, torch.get_num_threads(),
    )  # fmt: skip
    _status(status, "bf16 GEMV")
    return y


def i8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N] = x [M, K] @ (weight * scale[:, None]).T (weight int8 [N, K], scale fp32
    [N]), in fp32. x: fp32 [M, K] with contiguous rows; weight: contiguous rows."""
    if not i8_gemv_available():
        raise KernelUnavailableError("int8 GEMV: expected an AVX-512 CPU, got none")
    lib = _library()
    assert lib is not None
    m, k, n = _check(x, weight, torch.int8)
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n,) or not scale.is_contiguous():
        raise ValueError(
            f"scale: expected {n} contiguous fp32 values, got {scale.dtype} {tuple(scale.shape)}"
        )
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    status = lib.qk_i8_gemv(
        x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), scale.data_ptr(), n,
        weight.stride(0), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    _status(status, "int8 GEMV")
    return y
