"""Triton NVFP4 / MXFP4 kernel: y [M, N] = x [M, K] @ dequant(W).T (+ bias), fp32 accumulation.

W is read as compressed-tensors stores it (`quantkit.format.fp4`, `.nvfp4`, `.mxfp4`), with no
repack: `weight_packed` uint8 [N, K/2] (element k of a row: byte k // 2, low nibble for even k),
`weight_scale` [N, K/G] as bytes (float8_e4m3fn for NVFP4, G = 16; E8M0 exponents for MXFP4,
G = 32), NVFP4's `weight_global_scale` float32 [1].

Dequantization happens in registers and is bit-exact with `quantkit.format`: the E2M1 value and
the group scale are built from their bits (no fp8 conversion instruction, so any GPU and the
interpreter decode alike), NVFP4's effective scale is the IEEE quotient scale / global
(`tl.math.div_rn`, as torch divides), and value * scale is one fp32 product. The tile is cast to
the activation dtype for `tl.dot` (fp32 with input_precision="ieee", no TF32).

One kernel, `_fp4_gemm_kernel` (tiles [BLOCK_M, BLOCK_N], K loop, grouped program order), for
every M with one block configuration: a first fused path, not a tuned one (no GEMV/split-K).
NVFP4 W4A4: the activations are rounded to NVFP4 in torch first (`nvfp4_fake_quantize`, the
reference's emulation) and the kernel runs in fp32 on them; a fused activation quantizer is not
written.

As `w4a16`: this module imports Triton at its top; under `TRITON_INTERPRET=1` (set before
import) the kernels run on CPU tensors, fp16/fp32 only (numpy has no bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.format.nvfp4 import nvfp4_fake_quantize
from quantkit.fused_kernels.checks import check_prepared_input
from quantkit.fused_kernels.packed_weights import PackedFp4
from quantkit.fused_kernels.triton import launch as triton_launch

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 16, 64, 32, 8


@triton.jit
def _e2m1_value(nib):
    """fp32 value of E2M1 nibbles (int32 0..15), built from the bits: exponent e = bits 1-2,
    mantissa bit 0, sign bit 3; e = 0 is 0 or 0.5 (the subnormal)."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000)
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _scale_value(b, NV: tl.constexpr):
    """fp32 value of scale bytes (int32 0..255): E4M3 (NV) or E8M0 2^(b - 127)."""
    if NV:
        e = (b >> 3) & 0xF
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        value = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)  # m * 2^-9
        return tl.where((b & 0x80) != 0, -value, value)
    return tl.where(b > 0, b << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, y_ptr, M, N, K, GROUP_SIZE,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_ym, stride_yn,
    NV: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Tiled GEMM: program -> y[BLOCK_M, BLOCK_N] = x @ dequant(W).T (+ bias)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % size_m)
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if NV:
        g = tl.load(g_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0.0,
        )
        mask = (offs_k[:, None] < K) & mask_n[None, :]
        byte = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 2) * stride_wk,
            mask=mask,
            other=0,
        ).to(tl.int32)
        nib = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF
        sb = tl.load(
            s_ptr + offs_n[None, :] * stride_sn + (offs_k[:, None] // GROUP_SIZE) * stride_sg,
            mask=mask,
            other=0,
        ).to(tl.int32)
        scale = _scale_value(sb, NV)
        if NV:
            scale = tl.math.div_rn(scale, g)
        w = _e2m1_value(nib) * scale  # W.T tile [BLOCK_K, BLOCK_N], fp32, exact as torch's
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & mask_n[None, :])


def is_interpreted() -> bool:
    """True if the kernel was decorated under TRITON_INTERPRET=1 (it runs on CPU tensors)."""
    return triton_launch.is_interpreted(_fp4_gemm_kernel)


def fp4_linear_triton(
    x: torch.Tensor,
    weights: PackedFp4,
    *,
    act_dynamic: bool = False,
    bias: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T (+ bias) in x's dtype; `act_dynamic` (NVFP4
    W4A4): x rounded to NVFP4 on `input_global_scale` first, then an fp32 GEMM."""
    if check:
        weights.check(bias=bias)
        check_prepared_input(x, in_features=weights.in_features, backend="triton")
        triton_launch.check_device(x.device, x.dtype, interpreted=is_interpreted(), module=__name__)
    k, n = weights.in_features, weights.out_features
    lead, xk = x.shape[:-1], x.reshape(-1, k)
    if act_dynamic:
        if weights.input_global_scale is None:
            raise ValueError("input_global_scale: expected a tensor for W4A4, got none")
        xk = nvfp4_fake_quantize(xk, weights.input_global_scale)
    m = xk.shape[0]
    y = torch.empty(m, n, dtype=xk.dtype, device=x.device)
    nv = weights.kind == "nvfp4"
    scale = weights.weight_scale.view(torch.uint8)
    g = weights.weight_global_scale if nv else scale  # any pointer when unused
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _fp4_gemm_kernel[grid](
        xk, weights.weight_packed, scale, g, bias if bias is not None else y, y,
        m, n, k, weights.group_size,
        xk.stride(0), xk.stride(1), weights.weight_packed.stride(0),
        weights.weight_packed.stride(1), scale.stride(0), scale.stride(1), y.stride(0),
        y.stride(1),
        NV=nv, HAS_BIAS=bias is not None, DOT_PRECISION="ieee",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
    )  # fmt: skip
    return y.to(x.dtype).reshape(*lead, n)
