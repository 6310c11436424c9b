"""Triton W4A16 kernels: y [M, N] = x [M, K] @ dequant(W).T (+ bias), fp32 accumulation.

W is read as compressed-tensors stores it (see `quantkit.format.packing`), with no repack:
`weight_packed` int32 [N, ceil(K/8)] (nibble of element k of a row: word k // 8, bits
4 * (k % 8)), `weight_scale` [N, K/G], `weight_zero_point` int32 [ceil(N/8), K/G] packed along
N (row n: word n // 8, bits 4 * (n % 8)), or no zero point (symmetric). Each K step of BLOCK_K
elements lies inside one group (the launcher keeps BLOCK_K <= G, see `configs`), so a
step needs one scale and zero point per output row.

Dequantization happens in registers: nibble u -> (u - z) * s with z = 8 + zp the stored
zero-point nibble (q - zp = u - z exactly, as integers), in fp32, then cast to the activation
dtype for `tl.dot` (fp16/bf16 on GPUs; fp32 with input_precision="ieee", no TF32, under the
interpreter and for fp32 activations).

- `_w4a16_gemm_kernel` (prefill, M > 16): tiles [BLOCK_M, BLOCK_N], K loop, grouped program
  order for L2 reuse (the Triton matmul tutorial's).
- `_w4a16_gemv_kernel` (decode, M <= 16): one program per (BLOCK_N rows, K split); every
  activation row in one program so each weight tile is dequantized once; split-K partial sums
  meet in an fp32 buffer by atomic add (their order varies: results can differ in the last bits
  between runs when SPLIT_K > 1).
- `_w4_dequant_kernel`: writes the tile the other two compute with (codes, zero points,
  dequantized W); tests compare it bit for bit with `quantkit.format.packing`.

This module imports Triton at its top (the kernels are decorated at import); nothing imports it
except `kernel_registry` and tests, lazily. Under `TRITON_INTERPRET=1` (set before this module is
imported: `jit` reads it at decoration time) the kernels run on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from quantkit.fused_kernels.checks import check_int4_operands, resolve_group_size
from quantkit.fused_kernels.packed_weights import PackedInt4
from quantkit.fused_kernels.triton import launch as triton_launch
from quantkit.fused_kernels.triton.configs import (
    BlockConfig,
    clamp_block_k,
    gemm_configs,
    gemv_block_m,
    gemv_configs,
    interpreter_config,
    m_bucket,
    max_block_k,
    words_blocks,
)


@triton.jit
def _dequant_tile(
    w_ptr, s_ptr, zp_ptr, offs_k, offs_n, k0, K, N, GROUP_SIZE,
    stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    HAS_ZP: tl.constexpr,
):  # fmt: skip
    """W.T tile [BLOCK_K, BLOCK_N] in fp32 for K indices offs_k (all in group k0 // G)."""
    mask_n = offs_n < N
    mask = (offs_k[:, None] < K) & mask_n[None, :]
    words = tl.load(
        w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 8) * stride_wk, mask=mask, other=0
    )
    # `>>` on int32 is arithmetic, but the & 0xF keeps only the 4 bits that were shifted down.
    u = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    g = k0 // GROUP_SIZE
    s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZP:
        zw = tl.load(zp_ptr + (offs_n // 8) * stride_zn + g * stride_zg, mask=mask_n, other=0)
        z = (zw >> ((offs_n % 8) * 4)) & 0xF
    else:
        z = tl.full(offs_n.shape, 8, tl.int32)
    return (u - z[None, :]).to(tl.float32) * s[None, :]


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, zp_ptr, b_ptr, y_ptr, M, N, K, GROUP_SIZE,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Tiled GEMM: program -> y[BLOCK_M, BLOCK_N]; grouped order so GROUP_M row blocks share
    the weight tiles they read while those are still in L2."""
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
        w = _dequant_tile(
            w_ptr, s_ptr, zp_ptr, offs_k, offs_n, k0, K, N, GROUP_SIZE,
            stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, HAS_ZP,
        )  # fmt: skip
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(
        y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


@triton.jit
def _gemv_words_step(
    acc, x_ptr, w_ptr, s_ptr, zp_ptr, offs_m, offs_n, k0, k_end, M, N, GROUP_SIZE,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RESHAPE: tl.constexpr,
):  # fmt: skip
    """One K step of the GEMV for 1..8 rows, reading W as it is stored: a [BLOCK_N, BLOCK_K / 8]
    tile of whole int32 words (contiguous along K, so wide loads, each word read once), split
    into its 8 nibbles in registers ([BLOCK_N, words, 8]; with RESHAPE, flattened to
    [BLOCK_N, BLOCK_K]). acc [BLOCK_M, BLOCK_N] += x[:, step] @ dequant(W)[:, step].T."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_e = tl.arange(0, 8)
    mask_n = offs_n < N
    words = tl.load(
        w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :] * stride_wk,
        mask=mask_n[:, None] & (offs_w[None, :] * 8 < k_end),
        other=0,
    )
    g = k0 // GROUP_SIZE
    s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZP:
        zw = tl.load(zp_ptr + (offs_n // 8) * stride_zn + g * stride_zg, mask=mask_n, other=0)
        z = (zw >> ((offs_n % 8) * 4)) & 0xF
    else:
        z = tl.full(offs_n.shape, 8, tl.int32)
    u = (words[:, :, None] >> (offs_e * 4)[None, None, :]) & 0xF  # [BLOCK_N, words, 8]
    offs_k = offs_w[:, None] * 8 + offs_e[None, :]  # [words, 8]
    if RESHAPE:
        w = (tl.reshape(u, (offs_n.shape[0], BLOCK_K)) - z[:, None]).to(tl.float32) * s[:, None]
        offs_k = tl.reshape(offs_k, (BLOCK_K,))
    else:
        w = (u - z[:, None, None]).to(tl.float32) * s[:, None, None]
    for r in tl.static_range(BLOCK_M):
        x = tl.load(
            x_ptr + r * stride_xm + offs_k * stride_xk,
            mask=(offs_k < k_end) & (offs_k * 0 + r < M),
            other=0.0,
        ).to(tl.float32)
        if RESHAPE:
            part = tl.sum(w * x[None, :], axis=1)
        else:
            part = tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
        acc += tl.where(offs_m[:, None] == r, part[None, :], 0.0)
    return acc


@triton.jit
def _gemv_groups_step(
    acc, x_ptr, w_ptr, s_ptr, zp_ptr, offs_m, offs_n, k0, k_end, M, N, GROUP_SIZE,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_GROUPS: tl.constexpr,
):  # fmt: skip
    """`_gemv_words_step` for a step of STEP_GROUPS whole groups (BLOCK_K = STEP_GROUPS * G): the
    words as [BLOCK_N, groups, words per group, 8] nibbles, one scale and zero point per row and
    group, each group's sum scaled once. Long steps put more bytes in flight per program."""
    WORDS: tl.constexpr = BLOCK_K // STEP_GROUPS // 8  # words of a group
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_e = tl.arange(0, 8)
    mask_n = offs_n < N
    words = tl.load(
        w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :] * stride_wk,
        mask=mask_n[:, None] & (offs_w[None, :] * 8 < k_end),
        other=0,
    )
    words = tl.reshape(words, (offs_n.shape[0], STEP_GROUPS, WORDS))
    u = (words[:, :, :, None] >> (offs_e * 4)[None, None, None, :]) & 0xF
    g = k0 // GROUP_SIZE + tl.arange(0, STEP_GROUPS)
    mask_g = mask_n[:, None] & (g[None, :] * GROUP_SIZE < k_end)
    s = tl.load(
        s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg, mask=mask_g, other=0.0
    )
    if HAS_ZP:
        zw = tl.load(
            zp_ptr + (offs_n // 8)[:, None] * stride_zn + g[None, :] * stride_zg, mask=mask_g,
            other=0,
        )  # fmt: skip
        z = (zw >> ((offs_n % 8) * 4)[:, None]) & 0xF
    else:
        z = tl.full((offs_n.shape[0], STEP_GROUPS), 8, tl.int32)
    q = (u - z[:, :, None, None]).to(tl.float32)  # [BLOCK_N, groups, words, 8]
    offs_k = tl.reshape(k0 + tl.arange(0, BLOCK_K), (STEP_GROUPS, WORDS, 8))
    for r in tl.static_range(BLOCK_M):
        x = tl.load(
            x_ptr + r * stride_xm + offs_k * stride_xk,
            mask=(offs_k < k_end) & (offs_k * 0 + r < M),
            other=0.0,
        ).to(tl.float32)
        per_group = tl.sum(tl.sum(q * x[None, :, :, :], axis=3), axis=2)  # [BLOCK_N, groups]
        part = tl.sum(per_group * s.to(tl.float32), axis=1)
        acc += tl.where(offs_m[:, None] == r, part[None, :], 0.0)
    return acc


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, w_ptr, s_ptr, zp_ptr, y_ptr, M, N, K, GROUP_SIZE,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UNPACK: tl.constexpr = 0, STEP_GROUPS: tl.constexpr = 1,
):  # fmt: skip
    """Split-K GEMV: program (pid_n, pid_k) -> partial y[:M, BLOCK_N] over its K range.

    UNPACK (1..8 rows only; 16 rows always take 0): 0 dequantizes a [BLOCK_K, BLOCK_N] tile
    gathered nibble by nibble (each word addressed 8 times), 1 and 2 read whole words
    (`_gemv_words_step`; with STEP_GROUPS > 1 a step spans that many groups,
    `_gemv_groups_step`). Autotune picks among them per shape. SPLIT_K == 1 stores y (in y's
    dtype); otherwise y is an fp32 buffer the launcher zeroed and the partial sums are
    atomically added.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Each split takes a whole number of BLOCK_K steps (so steps never straddle groups).
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = min(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BLOCK_M < 16 and UNPACK > 0 and STEP_GROUPS > 1:
            acc = _gemv_groups_step(
                acc, x_ptr, w_ptr, s_ptr, zp_ptr, offs_m, offs_n, k0, k_end, M, N, GROUP_SIZE,
                stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn,
                stride_zg, HAS_ZP, BLOCK_M, BLOCK_K, STEP_GROUPS,
            )  # fmt: skip
        elif BLOCK_M < 16 and UNPACK > 0:
            acc = _gemv_words_step(
                acc, x_ptr, w_ptr, s_ptr, zp_ptr, offs_m, offs_n, k0, k_end, M, N, GROUP_SIZE,
                stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn,
                stride_zg, HAS_ZP, BLOCK_M, BLOCK_K, UNPACK == 2,
            )  # fmt: skip
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end),
                other=0.0,
            )
            w = _dequant_tile(
                w_ptr, s_ptr, zp_ptr, offs_k, offs_n, k0, K, N, GROUP_SIZE,
                stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, HAS_ZP,
            )  # fmt: skip
            if BLOCK_M >= 16:
                # tl.dot needs M >= 16 on tensor cores; padding rows cost nothing here: the
                # step is bound by reading the weight tile, not by the math.
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
            else:
                # x [BM, BK, 1] * w [1, BK, BN] summed over K: plain FMAs for 1..8 rows.
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit
def _w4_dequant_kernel(
    w_ptr, s_ptr, zp_ptr, codes_ptr, zeros_ptr, out_ptr, N, K, GROUP_SIZE,
    stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """codes [N, K] int8 (q = u - 8), zeros [N, K/G] int32 (zp = z - 8) and dequant(W) [N, K]
    fp32, through the same `_dequant_tile` the matmul kernels use."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    w = _dequant_tile(
        w_ptr, s_ptr, zp_ptr, offs_k, offs_n, k0, K, N, GROUP_SIZE,
        stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, HAS_ZP,
    )  # fmt: skip
    tl.store(out_ptr + offs_n[None, :] * K + offs_k[:, None], w, mask=mask)
    words = tl.load(
        w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 8) * stride_wk, mask=mask, other=0
    )
    u = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    tl.store(codes_ptr + offs_n[None, :] * K + offs_k[:, None], (u - 8).to(tl.int8), mask=mask)
    if HAS_ZP:
        g = k0 // GROUP_SIZE
        zw = tl.load(zp_ptr + (offs_n // 8) * stride_zn + g * stride_zg, mask=offs_n < N, other=0)
        z = (zw >> ((offs_n % 8) * 4)) & 0xF
        groups = tl.cdiv(K, GROUP_SIZE)
        tl.store(zeros_ptr + offs_n * groups + g, z - 8, mask=offs_n < N)


# --------------------------------------------------------------------------- launchers


def is_interpreted() -> bool:
    """True if the kernels were decorated under TRITON_INTERPRET=1 (they run on CPU tensors)."""
    return triton_launch.is_interpreted(_w4a16_gemm_kernel)


@functools.cache
def _autotuned(kind: str, bucket: int) -> triton.runtime.Autotuner:
    """The `kind` kernel wrapped in triton.autotune with the candidates of one M bucket (a
    cache of wrappers, one per (kind, bucket); each keeps its own tuning results)."""
    if kind == "gemv":
        return triton.autotune(
            configs=gemv_configs(bucket),
            key=["N", "K", "GROUP_SIZE"],
            prune_configs_by={"early_config_prune": clamp_block_k},
            reset_to_zero=["y_ptr"],  # split-K adds into y: every trial starts from zeros
        )(_w4a16_gemv_kernel)
    return triton.autotune(
        configs=gemm_configs(bucket),
        key=["N", "K", "GROUP_SIZE"],
        prune_configs_by={"early_config_prune": clamp_block_k},
    )(_w4a16_gemm_kernel)


def _weight_args(
    wp: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None
) -> tuple[torch.Tensor, int, int, int, int]:
    """(zero-point tensor or a stand-in, then the strides the kernels take after the weights')."""
    zp_t = zp if zp is not None else wp  # never read when HAS_ZP is False
    zs = (zp.stride(0), zp.stride(1)) if zp is not None else (0, 0)
    return zp_t, scale.stride(0), scale.stride(1), *zs


def w4a16_linear_triton(
    x: torch.Tensor,
    weights: PackedInt4,
    *,
    bias: torch.Tensor | None = None,
    path: str = "auto",
    config: BlockConfig | None = None,
    check: bool = True,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T (+ bias) in x.dtype.

    `path`: "gemv" (M <= 16), "gemm" or "auto" (gemv when M <= 16). `config` fixes the blocks
    (default: autotuned per M bucket on a GPU, `interpreter_config` under the interpreter).
    `weights.group_size` is resolved (in_features for per channel); `check=False` skips operand
    checks.
    """
    weight_packed, weight_scale, weight_zero_point = weights.tensors
    in_features = weights.in_features
    group_size = resolve_group_size(weights.group_size, in_features)
    if check:
        if group_size != weights.group_size:
            weights = dataclasses.replace(weights, group_size=group_size)
        check_int4_operands(x, weights, bias=bias, backend="triton")
    triton_launch.check_launch(x, path, interpreted=is_interpreted(), module=__name__)
    k, n = in_features, weight_packed.shape[0]
    lead, x2, m, kind = triton_launch.rows(x, k, path)
    if m == 0:
        return x.new_empty(*lead, n)
    zp_t, *strides = _weight_args(weight_packed, weight_scale, weight_zero_point)
    common: dict = dict(HAS_ZP=weight_zero_point is not None, DOT_PRECISION="ieee")
    if config is None and is_interpreted():
        config = interpreter_config(kind, m, group_size=group_size, in_features=k)
    tuned = functools.partial(_autotuned, kind, m_bucket(m))
    if kind == "gemv":
        if config is not None and config.unpack and gemv_block_m(m) < 16:
            block_k, step_groups = words_blocks(config.block_k, group_size, k)
            config = dataclasses.replace(config, block_k=block_k)
            common.update(STEP_GROUPS=step_groups)
        block_m, y = triton_launch.gemv_buffer(m, n, x.device, config)
        args = (
            x2, weight_packed, weight_scale, zp_t, y, m, n, k, group_size,
            x2.stride(0), x2.stride(1), weight_packed.stride(0), weight_packed.stride(1),
            *strides, y.stride(0), y.stride(1),
        )  # fmt: skip
        triton_launch.launch(
            "gemv", _w4a16_gemv_kernel, tuned, args, m=m, n=n, config=config, BLOCK_M=block_m,
            **common,
        )  # fmt: skip
        return triton_launch.gemv_result(y, x, bias, lead)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (
        x2, weight_packed, weight_scale, zp_t, bias if bias is not None else y, y, m, n, k,
        group_size, x2.stride(0), x2.stride(1), weight_packed.stride(0), weight_packed.stride(1),
        *strides, y.stride(0), y.stride(1),
    )  # fmt: skip
    triton_launch.launch(
        "gemm", _w4a16_gemm_kernel, tuned, args, m=m, n=n, config=config,
        HAS_BIAS=bias is not None, **common,
    )  # fmt: skip
    return y.reshape(*lead, n)


def dequantize_triton(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    in_features: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes int8 [N, K], zero points int32 [N, K/G] or None, dequant(W) fp32 [N, K]) as the
    matmul kernels see them: the oracle test of the kernels' unpacking."""
    group_size = resolve_group_size(group_size, in_features)
    n, k = weight_packed.shape[0], in_features
    triton_launch.check_device(
        weight_packed.device, torch.float32, interpreted=is_interpreted(), module=__name__
    )
    dev = weight_packed.device
    codes = torch.empty(n, k, dtype=torch.int8, device=dev)
    zeros = torch.empty(n, k // group_size, dtype=torch.int32, device=dev)
    out = torch.empty(n, k, dtype=torch.float32, device=dev)
    zp_t, *strides = _weight_args(weight_packed, weight_scale, weight_zero_point)
    block_k = max_block_k(group_size, k, cap=64)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, block_k))
    _w4_dequant_kernel[grid](
        weight_packed, weight_scale, zp_t, codes, zeros, out, n, k, group_size,
        weight_packed.stride(0), weight_packed.stride(1), *strides,
        HAS_ZP=weight_zero_point is not None, BLOCK_N=64, BLOCK_K=block_k,
    )  # fmt: skip
    return codes, (zeros if weight_zero_point is not None else None), out
