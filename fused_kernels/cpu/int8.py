"""CPU INT8 W8A8 linear: int8 x int8 dot products (vpdpbusd, AVX512-VNNI), decode and prefill.

y [..., N] = (q(x) @ W8.T) * sx * sw (+ bias), W8 int8 [N, K] and sw [N, 1] as compressed-tensors
`int-quantized` stores them, x quantized per token at run time (`csrc/int8.c`). One C call
quantizes the activations and multiplies, for any number of rows: the integer sums are exact,
so a prefill of 512 rows and a decode row get the reference's (`reference.int8`) bits alike.

The kernel reads the weights as the int8 head's GEMV does (`bf16_gemv.I8I8Weight`, `csrc/
bf16_gemv.c qk_i8i8_gemv`): W8 + 128 as bytes, 16 rows interleaved (`launch.interleave16`),
made once per layer when it is bound (`CpuInt8Layer`). The price is memory: the layer holds its
checkpoint tensor and that copy, as the INT4 int8 tile does. Where the CPU has no AVX512-VNNI
the registry runs the reference instead (`int8_cpu_available`).
"""

from __future__ import annotations

import torch

from quantkit.cpu import cpu_flags
from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.checks import check_fp8_activations, check_int8_weights
from quantkit.fused_kernels.cpu import launch as cpu_launch
from quantkit.fused_kernels.cpu.launch import interleave16, require_cpu, rows_stride

__all__ = [
    "CpuInt8Layer",
    "W8A8Weight",
    "int8_cpu_available",
    "int8_linear_cpu",
    "quantize_tokens_cpu",
]

# The compiled kernels (csrc/int8.c, typed by `abi`): _library(variant=None).
_library = cpu_launch.library_loader("qk_int8_cpu")


def int8_cpu_available(variant: str | None = None) -> bool:
    """True if this CPU has AVX512-VNNI and the kernel builds here with it (built on first
    call)."""
    if "avx512_vnni" not in cpu_flags():
        return False
    try:
        return bool(_library(variant).qk_w8a8_available())
    except KernelUnavailableError:
        return False


def _padded_k(k: int) -> int:
    return (k + 3) // 4 * 4


def _status(status: int, what: str) -> None:
    if status == 1:
        raise ValueError(f"{what}: expected K >= 1 and a weight laid out for this K")
    if status == 2:
        raise MemoryError(f"{what}: expected a scratch buffer, got allocation failure")
    if status:
        raise KernelUnavailableError(f"{what}: expected a CPU with AVX512-VNNI (status {status})")


class W8A8Weight:
    """An int8 weight [N, K] with its scales (and bias) laid out for `qk_w8a8_gemm`: W8 + 128
    as bytes with 16 rows interleaved ([ceil(N / 16)][Kp / 4][16] words, Kp = K rounded up to a
    multiple of 4, zero weights past K), scale and bias fp32 padded to whole tiles."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        n, k = check_int8_weights(weight, weight_scale, bias=bias)
        require_cpu(weight)
        self.out_features, self.in_features, self.kp = n, k, _padded_k(k)
        u8 = (weight.to(torch.int16) + 128).to(torch.uint8)
        if self.kp != k:
            u8 = torch.cat([u8, u8.new_full((n, self.kp - k), 128)], dim=1)
        self.words = interleave16(u8.contiguous().view(torch.int32))
        pad = -n % 16
        self.scale = torch.cat([weight_scale.reshape(n).float(), torch.zeros(pad)])
        self.bias = None if bias is None else torch.cat([bias.float(), torch.zeros(pad)])

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * 4
        return self.words.numel() * 4 + self.scale.numel() * 4 + extra

    def __call__(self, x: torch.Tensor, *, variant: str | None = None) -> torch.Tensor:
        """y [..., N] in x.dtype (computed in fp32) for x [..., K] on the CPU."""
        k, n = self.in_features, self.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32:
            x2 = x2.float()  # exact for bf16 / fp16
        x2 = rows_stride(x2)
        m = x2.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        status = _library(variant).qk_w8a8_gemm(
            x2.data_ptr(), m, k, x2.stride(0), self.words.data_ptr(), self.kp,
            self.scale.data_ptr(), None if self.bias is None else self.bias.data_ptr(), n,
            y.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            _status(status, "qk_w8a8_gemm")
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.reshape(*lead, n)


def quantize_tokens_cpu(
    x: torch.Tensor, *, variant: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 codes [..., K], fp32 scale [..., 1]) in C, as the kernel quantizes
    its activations: bit-identical to `quantkit.format.packing.int8_absmax` (tested)."""
    k = x.shape[-1]
    x2 = rows_stride(x.reshape(-1, k).float())
    m, kp = x2.shape[0], _padded_k(k)
    codes = torch.empty(m, kp, dtype=torch.int8)
    scales = torch.empty(m, dtype=torch.float32)
    sums = torch.empty(m, dtype=torch.int32)
    status = _library(variant).qk_w8a8_quant_tokens(
        x2.data_ptr(), m, k, x2.stride(0), codes.data_ptr(), kp, scales.data_ptr(),
        sums.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        _status(status, "qk_w8a8_quant_tokens")
    return codes[:, :k].reshape(x.shape), scales.reshape(*x.shape[:-1], 1)


def int8_linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    check: bool = True,
    variant: str | None = None,
) -> torch.Tensor:
    """y [..., N] = (q(x) @ W8.T) * sx * sw (+ bias) in x.dtype, computed as the reference
    does. An unbound call lays the weight out on every call; bind it once (`CpuInt8Layer`)."""
    if check:
        check_int8_weights(weight, weight_scale, bias=bias)
        check_fp8_activations(x, weight, backend="cpu")
        require_cpu(x)
    return W8A8Weight(weight, weight_scale, bias)(x, variant=variant)


class CpuInt8Layer:
    """One INT8 W8A8 linear with its weights laid out for the kernel once (`W8A8Weight`); a
    call passes only x. Holds the copy, not the tensors it was made from: build a new one if
    the layer's tensors are replaced."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        variant: str | None = None,
    ) -> None:
        self.weights = W8A8Weight(weight, weight_scale, bias)
        self.in_features, self.out_features = self.weights.in_features, self.weights.out_features
        self.variant = variant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu:
            raise KernelUnavailableError(f"cpu backend: expected CPU tensors, got {x.device}")
        return self.weights(x, variant=self.variant)
