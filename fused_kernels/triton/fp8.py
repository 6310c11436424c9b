"""Triton FP8 kernels: y [M, N] = x [M, K] @ (w8 * s).T (+ bias), fp32 accumulation.

W is read as compressed-tensors stores it (`quantkit.format.packing`): `weight` float8_e4m3fn [N,
K],
`weight_scale` [N, 1], one scale per output row, so the scale is applied once per output in the
epilogue, after the K loop, not per weight.

- W8A16 (`act_dynamic=False`), every CUDA GPU: the fp8 tile is upcast in registers to the
  activation dtype (exact: every e4m3 value is an fp16 and a bf16 value) and fed to `tl.dot`.
- W8A8 (`act_dynamic=True`), GPUs with fp8 tensor cores (sm_89+): `_quant_tokens_kernel` rounds
  each activation row to fp8 with its own scale (row absmax / 448), bit-identical to
  `quantkit.format.packing.quantize_fp8_per_token`; the GEMM then runs `tl.dot` on fp8 operands and
  scales the fp32 result by sx * sw. On an older GPU this launcher refuses W8A8
  (`KernelUnavailableError`); `prepared_linear` falls back to W8A16 with one warning line.
- `_fp8_gemm_kernel` (prefill, M > 16): tiles [BLOCK_M, BLOCK_N], K loop, grouped program order
  for L2 reuse (the Triton matmul tutorial's).
- `_fp8_gemv_kernel` (decode, M <= 16): one program per (BLOCK_N rows, K split), all activation
  rows in one program so each weight tile is read once; split-K partial sums meet in an fp32
  buffer by atomic add. For W8A8 it takes the fp8 activations and upcasts them (decode is
  bound by reading W; fp8 math would not make it faster).

fp32 -> e4m3 is done with integer operations (`_e4m3_code`), not `.to(tl.float8e4nv)`: the
interpreter's cast truncates where rounding carries into the exponent (7.95 -> 4.0 instead of
8.0, Triton 3.9), and the explicit rounding is the same on every target. Divisions use
`tl.math.div_rn` (IEEE, as torch's) rather than `/`, which may lower to an approximate
division on GPUs.

As `w4a16`: this module imports Triton at its top; under `TRITON_INTERPRET=1` (set before
import) the kernels run on CPU tensors, fp16/fp32 only (numpy has no bf16).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.checks import check_fp8_activations, check_fp8_weights
from quantkit.fused_kernels.triton import launch as triton_launch
from quantkit.fused_kernels.triton.configs import BlockConfig, gemv_block_m, m_bucket

_EPS = 1e-10  # quantkit.format.packing's smallest scale
# W8A8 GEMM: K products summed in the fp8 MMA's accumulator before each move to fp32 (see
# `_fp8_gemm_kernel`); 0: once a K step. `python -m quantkit.evals.kernels.fp8_accumulation` on
# an H200 (bf16; error max |y - ref| / max |x| @ |w|.T against fp64 on 4 shapes), M x N x K:
#   never (Triton's sm_90 default): 3.3e-4..6.7e-4; 2048x4096x14336 323 us, 512x14336x4096 271 us
#   once a K step (0):              8.7e-6..5.8e-5; 339 us, 273 us
#   every MMA (32):                 3.3e-6..1.6e-5; 413 us, 290 us
_PROMOTE_K = 0


@triton.jit
def _e4m3_code(v):
    """fp32 v (|v| <= 448) -> e4m3 code (int32), rounded to nearest even as torch rounds."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    ax = bits & 0x7FFFFFFF
    # below 2^-6: steps of 2^-9; adding 2^23 rounds a * 2^9 to an integer (to even), exactly
    a = ax.to(tl.float32, bitcast=True)
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    # normal: keep 3 of the 23 mantissa bits, round to even, rebias the exponent (127 -> 7)
    norm = ((ax + 0x7FFFF + ((ax >> 20) & 1)) >> 20) - (120 << 3)
    return tl.where(ax < (121 << 23), sub, norm) | sign


@triton.jit
def _quant_tokens_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm, EPS, BLOCK_K: tl.constexpr
):  # fmt: skip
    """Row m: s = max(absmax / 448, EPS); q = e4m3(clamp(x / s, +-448)) as uint8 codes."""
    m = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs * stride_xk, mask=offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), EPS)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs * stride_xk, mask=offs < K, other=0.0)
        v = tl.math.div_rn(x.to(tl.float32), scale)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(q_ptr + m * stride_qm + offs, _e4m3_code(v).to(tl.uint8), mask=offs < K)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_ym, stride_yn,
    HAS_XS: tl.constexpr, HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROMOTE_K: tl.constexpr = 0,
):  # fmt: skip
    """Tiled GEMM: program -> y[BLOCK_M, BLOCK_N] = (x @ w8.T) * [sx] * sw (+ bias).

    FP8_DOT: x is fp8 too and tl.dot multiplies the fp8 tiles (tensor cores on sm_89+);
    otherwise the fp8 tile is upcast to x's dtype first (W8A16). Hopper's fp8 MMA adds into its
    accumulator with fewer bits than fp32; PROMOTE_K > 0 moves the sum into a true fp32
    accumulator every PROMOTE_K products along K (32: after every MMA instruction), 0 once a
    K step (BLOCK_K), -1 never (Triton's default on sm_90: the whole K sum imprecise)."""
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        if FP8_DOT and PROMOTE_K < 0:
            acc = tl.dot(x, w, acc)
        elif FP8_DOT and PROMOTE_K == 0:
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
        elif FP8_DOT:
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=PROMOTE_K)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    mask_n = offs_n < N
    if HAS_XS:
        acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & mask_n[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, xs_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_ym, stride_yn,
    HAS_XS: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Split-K GEMV: program (pid_n, pid_k) -> partial y[:M, BLOCK_N] over its K range, scaled
    (the scales are per row and per token, so partial sums can be scaled before they meet).

    SPLIT_K == 1 stores y (in y's dtype); otherwise y is an fp32 buffer the launcher zeroed
    and the partial sums are atomically added. COMPUTE: the dtype both tiles are converted to
    (x's dtype for W8A16; fp16 or fp32 for the fp8 activations of W8A8, exact either way).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = min(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end),
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=(offs_k[:, None] < k_end) & (offs_n[None, :] < N),
            other=0.0,
        )
        if BLOCK_M >= 16:
            # tl.dot needs M >= 16; padding rows cost nothing, the step is bound by reading W
            acc = tl.dot(x.to(COMPUTE), w.to(COMPUTE), acc, input_precision=DOT_PRECISION)
        else:
            # x [BM, BK, 1] * w [1, BK, BN] summed over K: plain FMAs for 1..8 rows
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    mask_n = offs_n < N
    if HAS_XS:
        acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


# --------------------------------------------------------------------------- configurations

# Autotune candidates, as data: (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) for the GEMV, and
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for the GEMM. The GEMV reads 1-byte weights, so
# BLOCK_K = 256 gives each row 256-byte runs; BLOCK_K >= 32 everywhere (fp8 mma's K step).
_GEMV_TILES = [(64, 256, 1, 4, 3), (128, 128, 1, 4, 3), (64, 256, 4, 4, 3), (32, 512, 8, 4, 3)]
_GEMM_TILES = {
    64: [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)],
    256: [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4)],
}


def gemv_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s}, num_warps=w, num_stages=st)
        for n, k, s, w, st in _GEMV_TILES
    ]


def gemm_configs(bucket: int) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w,
                      num_stages=st)
        for m, n, k, w, st in _GEMM_TILES[64 if bucket <= 64 else 256]
    ]  # fmt: skip


def interpreter_config(kind: str, m: int) -> BlockConfig:
    """The fixed configuration under TRITON_INTERPRET=1 (split_k = 2 exercises the atomics)."""
    if kind == "gemv":
        return BlockConfig(block_m=gemv_block_m(m), block_n=64, block_k=128, split_k=2)
    return BlockConfig(block_m=min(64, max(16, m_bucket(m))), block_n=64, block_k=64)


@functools.cache
def _autotuned(kind: str, bucket: int) -> triton.runtime.Autotuner:
    """One autotuned wrapper per (kind, M bucket), each with its own tuning results."""
    if kind == "gemv":
        return triton.autotune(
            configs=gemv_configs(), key=["M", "N", "K"], reset_to_zero=["y_ptr"]
        )(_fp8_gemv_kernel)
    return triton.autotune(configs=gemm_configs(bucket), key=["N", "K"])(_fp8_gemm_kernel)


# --------------------------------------------------------------------------- launchers


def is_interpreted() -> bool:
    """True if the kernels were decorated under TRITON_INTERPRET=1 (they run on CPU tensors)."""
    return triton_launch.is_interpreted(_fp8_gemm_kernel)


def fp8_dot_supported(device: torch.device) -> bool:
    """True if tl.dot on fp8 operands runs on `device`: CUDA sm_89+ (Ada, Hopper, Blackwell), or
    the interpreter (which multiplies fp8 in numpy)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and is_interpreted()


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scale [M, 1]), bit-identical to
    `quantkit.format.packing.quantize_fp8_per_token`."""
    triton_launch.check_device(x.device, x.dtype, interpreted=is_interpreted(), module=__name__)
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_tokens_kernel[(m,)](
            x, codes, scales, k, x.stride(0), x.stride(1), codes.stride(0), _EPS,
            BLOCK_K=min(1024, triton.next_power_of_2(k)),
        )  # fmt: skip
    return codes.view(torch.float8_e4m3fn), scales


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act_dynamic: bool,
    bias: torch.Tensor | None = None,
    path: str = "auto",
    config: BlockConfig | None = None,
    check: bool = True,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (w8 * s).T (+ bias) in x.dtype; W8A8 when act_dynamic.

    `path`: "gemv" (M <= 16), "gemm" or "auto" (gemv when M <= 16). `config` fixes the blocks
    (default: autotuned per M bucket on a GPU, `interpreter_config` under the interpreter).
    """
    if check:
        check_fp8_weights(weight, weight_scale, bias=bias)
        check_fp8_activations(x, weight, backend="triton")
    triton_launch.check_launch(x, path, interpreted=is_interpreted(), module=__name__)
    if act_dynamic and not fp8_dot_supported(x.device):
        raise KernelUnavailableError(
            f"triton backend: W8A8 expected a GPU with fp8 tensor cores (sm_89+), got "
            f"{_describe(x.device)}; use W8A16"
        )
    n, k = weight.shape
    lead, x2, m, kind = triton_launch.rows(x, k, path)
    if m == 0:
        return x.new_empty(*lead, n)
    if config is None and is_interpreted():
        config = interpreter_config(kind, m)
    xs = None
    xin = x2
    if act_dynamic:
        xin, xs = quantize_per_token_triton(x2)
    scale = weight_scale.reshape(n, 1)
    common = dict(HAS_XS=xs is not None, DOT_PRECISION="ieee")
    w_args = (weight, scale, xs if xs is not None else scale)
    if kind == "gemv":
        block_m, y = triton_launch.gemv_buffer(m, n, x.device, config)
        # fp8 values are exact in every one of these; the interpreter computes in fp32
        compute = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(x.dtype)
        if act_dynamic:
            compute = tl.float16
        if compute is None or is_interpreted():
            compute = tl.float32
        args = (
            xin, *w_args, y, m, n, k, xin.stride(0), xin.stride(1), weight.stride(0),
            weight.stride(1), scale.stride(0), y.stride(0), y.stride(1),
        )  # fmt: skip
        triton_launch.launch(
            "gemv", _fp8_gemv_kernel, functools.partial(_autotuned, "gemv", 1), args, m=m, n=n,
            config=config, BLOCK_M=block_m, COMPUTE=compute, **common,
        )  # fmt: skip
        return triton_launch.gemv_result(y, x, bias, lead)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (
        xin, *w_args, bias if bias is not None else y, y, m, n, k, xin.stride(0), xin.stride(1),
        weight.stride(0), weight.stride(1), scale.stride(0), y.stride(0), y.stride(1),
    )  # fmt: skip
    triton_launch.launch(
        "gemm", _fp8_gemm_kernel, functools.partial(_autotuned, "gemm", m_bucket(m)), args,
        m=m, n=n,
        config=config, HAS_BIAS=bias is not None, FP8_DOT=act_dynamic, PROMOTE_K=_PROMOTE_K,
        **common,
    )  # fmt: skip
    return y.reshape(*lead, n)
