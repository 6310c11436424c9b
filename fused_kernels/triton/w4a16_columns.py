"""The one-row W4A16 GEMV on weights repacked by column, and the Triton INT4 layer that uses it.

Why a second layout. The checkpoint's `weight_packed` is [N, ceil(K/8)] int32, contiguous along
K: a GEMV tile of it gives each thread a run of K for a few output rows, so every thread loads
the activations of its own run, 16 bytes of x for every 4 bytes of weights. Nsight Compute on an
H200 (Llama-3-8B shapes, the best `w4a16` GEMV tiles) found the kernel bound by the L1 pipe: L1
throughput 70-79%, L1 hit rate 79-85% (those repeated x loads), DRAM 8-10%, 155 registers a
thread at 19% occupancy for q/o. Here the words are transposed once, when a layer is prepared:
`columns` [ceil(K/8), N] (N contiguous), scales and zero points [K/G, N]. A warp then loads
consecutive output columns (coalesced), the x of a word row is the same for every thread (one
broadcast), and each thread reuses it across its columns.

Per nibble: shift, mask, OR into the bits of 2^23 + u, subtract 2^23 (exact, no int-to-float
conversion), one FMA with x. A step of BLOCK_W words lies inside one group, so a group's scale
and zero point are applied once per column and step: y += s * (sum x u - z * sum x).

`TritonInt4Layer` (the registry's bound layer for the triton backend) keeps both layouts: one
activation row (batch-1 decode) takes this kernel, everything else `w4a16.w4a16_linear_triton`
on the checkpoint's own tensors. The copy costs the layer's INT4 bytes again on the GPU.
Layers whose group size is not a multiple of 8 (a per-channel K that is not) keep the
checkpoint path alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.errors import KernelUnavailableError
from quantkit.format.packing import INT4_MIN, unpack_zero_points
from quantkit.fused_kernels.checks import resolve_group_size
from quantkit.fused_kernels.packed_weights import PackedInt4
from quantkit.fused_kernels.triton import launch as triton_launch
from quantkit.fused_kernels.triton.w4a16 import is_interpreted, w4a16_linear_triton

__all__ = ["ColumnWords", "TritonInt4Layer", "columns_gemv", "is_interpreted", "repack_columns",
           "w4a16_linear_triton"]  # fmt: skip


@triton.jit
def _w4a16_columns_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, WORDS, GROUP_SIZE, stride_xk, stride_wk, stride_sg,
    stride_zg,
    HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
    WAVES: tl.constexpr,
):  # fmt: skip
    """Program (pid_n, pid_k) -> y[BLOCK_N columns] partial over its share of the word rows.

    WAVES only sizes SPLIT_K (`_fit`). SPLIT_K == 1 stores; otherwise y is a zeroed fp32 buffer
    and the partial sums are added atomically (their order varies between runs)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_e = tl.arange(0, 8)
    # Each split takes whole steps, so a step never straddles two splits or two groups.
    per_split = tl.cdiv(tl.cdiv(WORDS, BLOCK_W), SPLIT_K) * BLOCK_W
    w_begin = pid_k * per_split
    w_end = min(w_begin + per_split, WORDS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(w_begin, w_end, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        words = tl.load(
            w_ptr + offs_w[:, None] * stride_wk + offs_n[None, :],
            mask=(offs_w[:, None] < w_end) & mask_n[None, :],
            other=0,
        )
        u = (words[:, None, :] >> (offs_e * 4)[None, :, None]) & 0xF  # [BLOCK_W, 8, BLOCK_N]
        f = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # 2^23 + u - 2^23 = u
        offs_k = offs_w[:, None] * 8 + offs_e[None, :]
        xk = tl.load(x_ptr + offs_k * stride_xk, mask=offs_k < K, other=0.0).to(tl.float32)
        g = (w0 * 8) // GROUP_SIZE
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZP:
            z = tl.load(z_ptr + g * stride_zg + offs_n, mask=mask_n, other=0.0)
        else:
            z = 8.0
        dot = tl.sum(tl.sum(f * xk[:, :, None], axis=1), axis=0)
        xsum = tl.sum(tl.sum(xk, axis=1), axis=0)
        acc += (dot - z * xsum) * s
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, acc, mask=mask_n)
    else:
        tl.atomic_add(y_ptr + offs_n, acc, mask=mask_n)


def _word_rows_limit(group_size: int, in_features: int) -> int:
    """The most word rows a step may take and stay in one group: the largest power of two
    dividing G / 8 (any number when the layer is one group)."""
    if group_size >= in_features:
        return 1 << 30
    words = group_size // 8
    return words & -words


def _fit(configs: list, named_args: dict, **kwargs: object) -> list:
    """`prune_configs_by` hook: clamp BLOCK_W to the group, and size SPLIT_K so that about WAVES
    programs run per multiprocessor (whole steps per split)."""
    n, k, group = named_args["N"], named_args["K"], named_args["GROUP_SIZE"]
    words = named_args["WORDS"]
    device = named_args["x_ptr"].device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out, seen = [], set()
    for cfg in configs:
        kw = dict(cfg.kwargs)
        kw["BLOCK_W"] = min(kw["BLOCK_W"], _word_rows_limit(group, k))
        steps = triton.cdiv(words, kw["BLOCK_W"])
        split = 1
        while split * 2 <= steps and split * 2 * triton.cdiv(n, kw["BLOCK_N"]) <= kw["WAVES"] * sms:
            split *= 2
        kw["SPLIT_K"] = split
        key = (tuple(sorted((a, v) for a, v in kw.items() if a != "WAVES")), cfg.num_warps,
               cfg.num_stages)  # fmt: skip
        if key not in seen:
            seen.add(key)
            out.append(triton.Config(kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return out


# (BLOCK_N, BLOCK_W, WAVES, num_warps, num_stages). The H200 search (Llama-3-8B shapes, bf16,
# group 128) found 256 columns x 8 word rows, 4 warps best at every shape, with 4 programs per
# SM for q/o and down and 8 for gate/up; the others are its runners-up.
_TILES = [(256, 8, 4, 4, 4), (256, 8, 8, 4, 1), (256, 8, 4, 4, 3), (256, 8, 8, 4, 3),
          (128, 16, 4, 4, 3), (128, 8, 8, 4, 3)]  # fmt: skip


def _configs() -> list:
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_W": w, "SPLIT_K": 1, "WAVES": waves},
                      num_warps=warps, num_stages=stages)
        for n, w, waves, warps, stages in _TILES
    ]  # fmt: skip


_tuned = triton.autotune(
    configs=_configs(),
    key=["N", "K", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": _fit},
    reset_to_zero=["y_ptr"],
)(_w4a16_columns_kernel)


class ColumnWords:
    """One layer's INT4 tensors by column: `words` [ceil(K/8), N] int32, `scale` [K/G, N] (the
    stored dtype), `zero` [K/G, N] fp32 zero-point nibbles or None (symmetric: 8)."""

    def __init__(self, weights: PackedInt4) -> None:
        packed, scale, zero = weights.tensors
        self.in_features = weights.in_features
        self.out_features = packed.shape[0]
        self.group_size = resolve_group_size(weights.group_size, weights.in_features)
        self.words = packed.t().contiguous()
        self.scale = scale.t().contiguous()
        self.zero = None
        if zero is not None:  # the stored nibbles (zero point - INT4_MIN), as the kernel reads
            nibbles = unpack_zero_points(zero, self.out_features) - INT4_MIN
            self.zero = nibbles.t().float().contiguous()

    @staticmethod
    def fits(weights: PackedInt4) -> bool:
        """True if a step of whole words can stay inside one group (G a multiple of 8)."""
        return resolve_group_size(weights.group_size, weights.in_features) % 8 == 0


def repack_columns(weights: PackedInt4) -> ColumnWords:
    """`weights` by column (a copy), for `columns_gemv`."""
    if not ColumnWords.fits(weights):
        raise ValueError(
            f"group_size: the column GEMV expected a multiple of 8, got {weights.group_size}"
        )
    return ColumnWords(weights)


def columns_gemv(
    x: torch.Tensor,
    cols: ColumnWords,
    *,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T (+ bias) for one row of x (x.numel() == K), in
    x's dtype. `config` fixes the tile (its SPLIT_K used as given); default: autotuned on a GPU,
    a fixed small tile under the interpreter."""
    k, n = cols.in_features, cols.out_features
    if x.numel() != k:
        raise ValueError(f"x: the column GEMV takes one row of {k}, got shape {tuple(x.shape)}")
    x1 = x.reshape(k)
    y = torch.zeros(1, n, dtype=torch.float32, device=x.device)  # a buffer for any SPLIT_K
    has_zp = cols.zero is not None
    z = cols.zero if has_zp else cols.scale  # never read when HAS_ZP is False
    args = (
        x1, cols.words, cols.scale, z, y, n, k, cols.words.shape[0], cols.group_size,
        x1.stride(0), cols.words.stride(0), cols.scale.stride(0), z.stride(0),
    )  # fmt: skip
    if config is None and is_interpreted():
        block_w = min(4, _word_rows_limit(cols.group_size, k))
        config = triton.Config(
            {"BLOCK_N": 64, "BLOCK_W": block_w, "SPLIT_K": 2, "WAVES": 0}, num_warps=4
        )
    if config is None:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
        _tuned[grid](*args, HAS_ZP=has_zp)
    else:
        kw = config.kwargs
        _w4a16_columns_kernel[(triton.cdiv(n, kw["BLOCK_N"]), kw["SPLIT_K"])](
            *args, HAS_ZP=has_zp, num_warps=config.num_warps, num_stages=config.num_stages, **kw
        )
    return triton_launch.gemv_result(y, x, bias, x.shape[:-1])


class TritonInt4Layer:
    """One INT4 linear for the triton backend: one activation row through `columns_gemv` on a
    column copy of the weights (made here, once), every other shape through
    `w4a16_linear_triton` on the checkpoint's tensors."""

    def __init__(self, weights: PackedInt4, *, bias: torch.Tensor | None = None) -> None:
        self.weights = weights
        self.bias = bias
        self.device = weights.device
        self.in_features = weights.in_features
        self.columns = ColumnWords(weights) if ColumnWords.fits(weights) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.device:
            raise KernelUnavailableError(
                f"triton backend: expected x on the weights' device {self.device}, got {x.device}"
            )
        if self.columns is not None and x.numel() == self.in_features:
            return columns_gemv(x, self.columns, bias=self.bias)
        return w4a16_linear_triton(x, self.weights, bias=self.bias, check=False)
