"""CPU FP8 linear (W8A16 and dynamic per-token W8A8): a compiled C GEMV for decode, dequantize +
MKL for prefill.

y [..., N] = x [..., K] @ (w8 * s).T (+ bias), w8 float8_e4m3fn [N, K] and s [N, 1] as
compressed-tensors stores them (`quantkit.format.packing`), read as stored: a call reads N*K bytes
of weight plus the scales.

- M <= `GEMV_MAX_M[variant]`: `qk_fp8_gemv` (see `csrc/fp8.c`) converts e4m3 -> fp32 in
  registers (exactly) and streams each weight row once per 4 activation rows, fp32 accumulation,
  OpenMP over output rows with torch's threads.
- larger M: `qk_fp8_dequant` writes fp32 row chunks of w8 * s (bit-identical to
  `quantkit.format.packing.dequantize_fp8`) and MKL multiplies them; with bf16 activations on CPUs
  with bf16 matmul instructions the chunks are rounded to bf16 and oneDNN multiplies (as
  `w4a16`).
- W8A8 (`act_dynamic`): no CPU multiplies fp8, so W8A8 is emulated with the GPU kernel's
  numerics: each activation row is rounded to fp8 with its own scale (bit-identical to
  `quantkit.format.packing.quantize_fp8_per_token`, in C), the fp8 products are exact in fp32 and
  the sum is scaled by sx * sw. It is as fast as W8A16 here, not faster: its use on CPU is to
  measure what W8A8 costs in accuracy.

The reference of the same function is `reference.fp8.fp8_linear_reference`; tests hold this
launcher to it.
"""

from __future__ import annotations

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.checks import check_fp8_activations, check_fp8_weights
from quantkit.fused_kernels.cpu import launch as cpu_launch
from quantkit.fused_kernels.cpu.abi import Fp8Layer
from quantkit.fused_kernels.cpu.build import DTYPE_CODES, cpu_variant
from quantkit.fused_kernels.cpu.launch import check_status, require_cpu, rows_stride
from quantkit.fused_kernels.cpu.w4a16 import has_bf16_matmul

# Largest M that takes the GEMV; above it dequantize + MKL. Measured at 4096x4096 on one Zen 5
# core (CPU time, GEMV vs dequantize + matmul, ms): avx512 fp32 M=64 13.8 vs 25.2, M=128 26.9
# vs 45.5; avx512 bf16 M=64 14.0 vs 31.5, M=128 27.2 vs 24.1 (oneDNN bf16); avx2 fp32 M=32 12.1
# vs 15.3; the plain-C loop loses already at M=2 (24.3 vs 5.0 ms): gcc does not vectorise its
# code conversion, so the generic build always dequantizes.
GEMV_MAX_M = {"avx512": 128, "avx2": 32, "generic": 0}
# bf16 activations on a CPU with bf16 matmul instructions (oneDNN's bf16 matmul beats fp32 MKL).
GEMV_MAX_M_BF16 = 64
# fp32 rows dequantized per MKL call in the prefill path (as `w4a16`).
_PREFILL_CHUNK_BYTES = 8 << 20


# The compiled kernels (csrc/fp8.c, typed by `abi`): _library(variant=None).
_library = cpu_launch.library_loader("qk_fp8_cpu")


def fp8_cpu_available() -> bool:
    """True if the C kernel builds and loads here (builds it on first call)."""
    return cpu_launch.loads(_library)


def _codes(weight: torch.Tensor) -> torch.Tensor:
    return rows_stride(weight).view(torch.uint8)


def nan_safe_scale(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """weight_scale, or an fp32 copy with NaN in the rows of `weight` holding a NaN code.

    The GEMV reads a NaN code as 480 (it does not test every weight, see `csrc/fp8.c`); a
    NaN scale makes such a row's outputs NaN, as the reference's are.
    """
    w = _codes(weight)
    n, k = w.shape
    flags = torch.empty(n, dtype=torch.uint8)
    if _library().qk_fp8_nan_rows(w.data_ptr(), n, k, w.stride(0), flags.data_ptr()) == 0:
        return weight_scale
    scale = weight_scale.reshape(n).float().clone()
    scale[flags.bool()] = float("nan")
    return scale.reshape(n, 1)


def dequantize_fp8_cpu(
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    *,
    rows: tuple[int, int] | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """w8 * s as fp32 [N, K] (rows n0..n1 only with `rows`; s = 1 when weight_scale is None),
    bit-identical to `quantkit.format.packing.dequantize_fp8`."""
    w = _codes(weight)
    n0, n1 = rows or (0, w.shape[0])
    k = w.shape[1]
    out = torch.empty(n1 - n0, k, dtype=torch.float32)
    scale = None if weight_scale is None else rows_stride(weight_scale.reshape(-1, 1))
    status = _library(variant).qk_fp8_dequant(
        w.data_ptr(), n0, n1, k, w.stride(0),
        None if scale is None else scale.data_ptr(), DTYPE_CODES[scale.dtype] if scale is not None
        else 0, 0 if scale is None else scale.stride(0), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    check_status(status, "qk_fp8_dequant")
    return out


def quantize_per_token_cpu(
    x: torch.Tensor, *, variant: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], fp32 scale [..., 1]) in C, bit-identical to
    `quantkit.format.packing.quantize_fp8_per_token`."""
    if x.dtype not in DTYPE_CODES:
        raise KernelUnavailableError(
            f"cpu backend: expected activations in float32, bfloat16 or float16, got {x.dtype}"
        )
    k = x.shape[-1]
    x2 = rows_stride(x.reshape(-1, k))
    m = x2.shape[0]
    codes = torch.empty(m, k, dtype=torch.uint8)
    scales = torch.empty(m, 1, dtype=torch.float32)
    status = _library(variant).qk_fp8_quant_tokens(
        x2.data_ptr(), DTYPE_CODES[x.dtype], m, k, x2.stride(0), codes.data_ptr(), scales.data_ptr()
    )
    check_status(status, "qk_fp8_quant_tokens")
    x8 = codes.view(torch.float8_e4m3fn).reshape(*x.shape)
    return x8, scales.reshape(*x.shape[:-1], 1)


def _prefill(
    x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, act_dynamic: bool
) -> torch.Tensor:
    """y [M, N] for large M: fp32 (or bf16) matmuls on dequantized row chunks of W, in fp32."""
    n, k = weight.shape
    bf16 = x2.dtype == torch.bfloat16 and has_bf16_matmul()
    if act_dynamic:
        # (x8 @ w8.T) * sx * sw, as the reference: the fp8 values are exact in bf16 too
        x8, sx = quantize_per_token_cpu(x2)
        xm = x8.to(torch.bfloat16 if bf16 else torch.float32)
    else:
        xm = x2 if bf16 else x2.float()
    out = torch.empty(x2.shape[0], n, dtype=xm.dtype)
    rows = max(8, _PREFILL_CHUNK_BYTES // (4 * k))
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = dequantize_fp8_cpu(weight, None if act_dynamic else scale, rows=(n0, n1))
        torch.matmul(xm, (w.to(torch.bfloat16) if bf16 else w).T, out=out[:, n0:n1])
    y = out.float()
    if act_dynamic:
        y = y * sx * scale.float().reshape(1, n)
    return y


def fp8_linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act_dynamic: bool,
    bias: torch.Tensor | None = None,
    check: bool = True,
    variant: str | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (w8 * s).T (+ bias), fp32 accumulation, in x.dtype.

    `act_dynamic`: W8A8 numerics (activations rounded to fp8 per token, see the module
    docstring). `check=False` skips the operand checks and the NaN-code scan for callers that
    ran them once (`CpuFp8Layer`). `variant` picks the instruction set (tests, benches).
    """
    if check:
        check_fp8_weights(weight, weight_scale, bias=bias)
        check_fp8_activations(x, weight, backend="cpu")
        require_cpu(x)
        weight_scale = nan_safe_scale(weight, weight_scale)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = rows_stride(x.reshape(-1, k))
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    max_m = GEMV_MAX_M[variant or cpu_variant()]
    if x.dtype == torch.bfloat16 and has_bf16_matmul():
        max_m = min(max_m, GEMV_MAX_M_BF16)
    scale = rows_stride(weight_scale.reshape(n, 1))
    if m > max_m:
        y = _prefill(x2, weight, scale, act_dynamic=act_dynamic)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*lead, n)
    w = _codes(weight)
    b = None if bias is None else bias.contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    status = _library(variant).qk_fp8_gemv(
        x2.data_ptr(), DTYPE_CODES[x.dtype], m, k, x2.stride(0), int(act_dynamic),
        w.data_ptr(), n, w.stride(0), scale.data_ptr(), DTYPE_CODES[scale.dtype], scale.stride(0),
        None if b is None else b.data_ptr(), 0 if b is None else DTYPE_CODES[b.dtype],
        out.data_ptr(), DTYPE_CODES[x.dtype], n, torch.get_num_threads(),
    )  # fmt: skip
    check_status(status, "qk_fp8_gemv")
    return out.reshape(*lead, n)


class CpuFp8Layer(cpu_launch.BoundGemvLayer):
    """One FP8 linear bound to the C GEMV once; a call passes only x and the output.

    As `w4a16.CpuInt4Layer`: at SmolLM2 sizes decode is dominated by per-call overhead, so
    the checks, the NaN-code scan, contiguity fixes and the static kernel arguments are settled
    here, at load time. Holds references to the tensors it was built from; build a new one if
    the layer's tensors are replaced.
    """

    gemv = "qk_fp8_gemv"

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        *,
        act_dynamic: bool,
        bias: torch.Tensor | None = None,
        variant: str | None = None,
    ) -> None:
        n, k = check_fp8_weights(weight, weight_scale, bias=bias)
        require_cpu(weight)
        w = weight.contiguous()
        scale = nan_safe_scale(w, weight_scale).reshape(n, 1).contiguous()
        b = None if bias is None else bias.contiguous()
        self.bias, self.act_dynamic = b, act_dynamic
        self.in_features, self.out_features = k, n
        max_m = GEMV_MAX_M[variant or cpu_variant()]
        layer = Fp8Layer(
            w.data_ptr(), n, k, w.stride(0), scale.data_ptr(), DTYPE_CODES[scale.dtype],
            scale.stride(0), None if b is None else b.data_ptr(),
            0 if b is None else DTYPE_CODES[b.dtype], int(act_dynamic),
        )  # fmt: skip
        self._bind(
            fp8_linear_cpu, (w, scale), dict(act_dynamic=act_dynamic, bias=b), variant=variant,
            layer=layer, fn=_library(variant).qk_fp8_gemv_layer, max_m=max_m,
            max_m_bf16=min(max_m, GEMV_MAX_M_BF16) if has_bf16_matmul() else max_m,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv(x)
