"""Block configurations of the Triton W4A16 kernels, as data.

Decode (M <= 16) and prefill tune separately: `m_bucket` maps M to a bucket, and
`gemv_configs(bucket)` / `gemm_configs(bucket)` return the `Config` candidates that
`autotune` tries on a GPU for that bucket. Under `TRITON_INTERPRET=1` nothing is tuned:
`interpreter_config` returns one fixed `BlockConfig`. Importing this module does not import
Triton; only the two `*_configs` functions do.

Why these blocks. The GEMV is bandwidth-bound: each program should read long runs of packed
words (BLOCK_K = 128 -> 64 bytes per row per step) and there must be enough programs to fill
the GPU (N / BLOCK_N * SPLIT_K >= a few per SM), hence split-K for the 4096-wide layers. The
GEMM follows the Triton matmul tutorial's tiles; BLOCK_K never exceeds the group size (the
launcher clamps it) so one K step needs one scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Largest M that takes the split-K GEMV path; above it the tiled GEMM is used.
GEMV_MAX_M = 16


@dataclass(frozen=True)
class BlockConfig:
    """One launch configuration (block sizes are powers of two)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 2
    unpack: int = 0  # W4A16 GEMV only: how a tile of words is unpacked (see `w4a16`)

    def meta(self, kind: str) -> dict[str, int]:
        """The constexpr keyword arguments of the `kind` ('gemm' or 'gemv') kernel."""
        meta = {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k}
        if kind == "gemm":
            meta.update(BLOCK_M=self.block_m, GROUP_M=self.group_m)
        else:
            meta.update(SPLIT_K=self.split_k)
            if self.unpack:
                meta.update(UNPACK=self.unpack)
        return meta


def m_bucket(m: int) -> int:
    """The autotune bucket of M: the next power of two, capped at 256 (beyond it the best GEMM
    tiles no longer change with M)."""
    if m < 1:
        raise ValueError(f"M: expected at least one row, got {m}")
    return min(256, 1 << (m - 1).bit_length())


def gemv_block_m(m: int) -> int:
    """BLOCK_M of the GEMV for M rows: all rows in one program, padded to a power of two."""
    if m > GEMV_MAX_M:
        raise ValueError(f"M: the GEMV path takes at most {GEMV_MAX_M} rows, got {m}")
    return 1 << (m - 1).bit_length()


def max_block_k(group_size: int, in_features: int, *, cap: int = 128) -> int:
    """The largest BLOCK_K (a power of two <= cap) that keeps a K step inside one group.

    Per channel (group_size == in_features) any BLOCK_K works: every step is in group 0.
    """
    if group_size == in_features:
        return cap
    block = cap
    while group_size % block:
        block //= 2
    return block


def interpreter_config(kind: str, m: int, *, group_size: int, in_features: int) -> BlockConfig:
    """The fixed configuration under TRITON_INTERPRET=1.

    The interpreter runs each program as numpy calls, so fewer, bigger blocks are faster; but
    the GEMV's [BLOCK_M, BLOCK_K, BLOCK_N] product must stay small. split_k = 2 so that tests
    exercise the atomic reduction.
    """
    block_k = max_block_k(group_size, in_features)
    if kind == "gemv":
        block_m = gemv_block_m(m)
        unpack = 1 if block_m < 16 else 0  # the tile of words, where it applies
        return BlockConfig(block_m=block_m, block_n=128, block_k=block_k, split_k=2, unpack=unpack)
    return BlockConfig(block_m=min(64, max(16, m_bucket(m))), block_n=64, block_k=block_k)


def words_blocks(block_k: int, group_size: int, in_features: int) -> tuple[int, int]:
    """(BLOCK_K, STEP_GROUPS) of a GEMV step that reads whole words (UNPACK > 0).

    A step may span several whole groups (STEP_GROUPS = BLOCK_K / G) when G is a power of two
    of at least 8 elements; otherwise it stays inside one group, as the other kernels' steps do.
    """
    if block_k > group_size and group_size != in_features and group_size >= 8:
        if group_size & (group_size - 1) == 0:
            return block_k, block_k // group_size
    return min(block_k, max_block_k(group_size, in_features, cap=1 << 30)), 1


def clamp_block_k(configs: list[Any], named_args: dict[str, Any], **_: Any) -> list[Any]:
    """`prune_configs_by` hook: fit each candidate's BLOCK_K to the group size (whole-word GEMV
    steps may span groups: `words_blocks`), and turn SPLIT_K = 0 into one K step per program."""
    import triton

    group, k = named_args["GROUP_SIZE"], named_args["K"]
    limit = max_block_k(group, k, cap=1 << 30)
    seen, out = set(), []
    for cfg in configs:
        kwargs = dict(cfg.kwargs, BLOCK_K=min(cfg.kwargs["BLOCK_K"], limit))
        if kwargs.get("UNPACK") and kwargs["BLOCK_K"] >= 8:
            block_k, step_groups = words_blocks(cfg.kwargs["BLOCK_K"], group, k)
            kwargs.update(
                BLOCK_K=block_k, **({"STEP_GROUPS": step_groups} if step_groups > 1 else {})
            )
        else:  # a tile of whole words needs a word per row
            kwargs.pop("UNPACK", None)
        if kwargs.get("SPLIT_K") == 0:
            kwargs["SPLIT_K"] = triton.cdiv(k, kwargs["BLOCK_K"])
        key = (tuple(sorted(kwargs.items())), cfg.num_warps, cfg.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config(kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return out


def _triton_config(meta: dict[str, int], num_warps: int, num_stages: int) -> Any:
    import triton  # lazy: only the GPU launcher asks for autotune candidates

    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


# Candidate tiles. Each was compiled for sm_90 with this Triton (no GPU here) and checked with
# `ptxas -v`: none spills, except where noted (the dequantized [BLOCK_K, BLOCK_N] tile lives in
# registers next to the accumulator: 128x256x64 GEMM tiles at 8 warps spilled 484 bytes, a
# 128x256 GEMV tile at 4 warps spilled 10 KB, so those are absent).
# GEMV: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, UNPACK). UNPACK 0 gathers a
# [BLOCK_K, BLOCK_N] tile nibble by nibble (4-byte loads, each word addressed 8 times); 1 and 2
# load [BLOCK_N, BLOCK_K / 8] whole words (contiguous along K: 16-byte loads) and split them in
# registers, 2 through a reshape to [BLOCK_N, BLOCK_K]. 16 rows go through tl.dot with 0.
# SPLIT_K 0 means one K step per program (`clamp_block_k` sets K / BLOCK_K).
_GEMV_TILES = {
    # The last four read whole words: measured on an H200 (`python -m
    # quantkit.evals.kernels.gemv_sweep`, CUDA-graph replay), the best of them took 25.4 / 71.1 /
    # 74.2 us at the Llama-3-8B q/o, gate/up and down shapes where the best gather tile took 31.1
    # / 100.1 / 89.3 us; at 4 rows the gather tiles stayed ahead, so that bucket has none.
    1: [
        (64, 128, 1, 4, 3, 0),
        (128, 128, 1, 4, 3, 0),
        (64, 128, 4, 4, 3, 0),
        (128, 256, 2, 8, 3, 0),
        (32, 256, 8, 4, 3, 0),
        (16, 128, 4, 2, 4, 1),
        (16, 128, 2, 2, 4, 2),
        (32, 256, 0, 4, 1, 1),
        (8, 512, 0, 2, 1, 1),
    ],
    4: [(64, 64, 1, 4, 3, 0), (64, 128, 2, 4, 3, 0), (32, 128, 4, 4, 3, 0), (64, 64, 4, 4, 3, 0)],
    # BLOCK_M = 16 goes through tl.dot (mma needs M >= 16)
    16: [(64, 64, 1, 4, 3, 0), (64, 128, 2, 4, 3, 0), (128, 64, 4, 4, 3, 0),
         (32, 128, 8, 4, 3, 0)],
}  # fmt: skip
# GEMM: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); 128x128x64 spills 104 bytes, kept
# because its BLOCK_K = 64 halves the scale/zero loads per FLOP of the 128x128x32 tile.
_GEMM_TILES = {
    64: [(32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 32, 4, 4), (128, 128, 32, 8, 3)],
    256: [(128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 4), (64, 64, 64, 4, 4),
          (256, 128, 32, 8, 3)],
}  # fmt: skip


def gemv_configs(bucket: int) -> list[Any]:
    """Autotune candidates (`Config`) of the split-K GEMV for an M bucket (1..16)."""
    tiles = _GEMV_TILES[1 if bucket <= 1 else 4 if bucket <= 4 else 16]
    return [
        _triton_config(
            {"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, **({"UNPACK": u} if u else {})},
            warps, stages,
        )
        for n, k, s, warps, stages, u in tiles
    ]  # fmt: skip


def gemm_configs(bucket: int) -> list[Any]:
    """Autotune candidates of the tiled GEMM for an M bucket (32..256)."""
    return [
        _triton_config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, warps, stages)
        for m, n, k, warps, stages in _GEMM_TILES[64 if bucket <= 64 else 256]
    ]
