"""Every W4A16 GEMV candidate, timed alone: `python -m quantkit.evals.kernels.gemv_sweep`.

Autotune keeps only its winner; this prints each candidate of `configs.gemv_configs` (and the
autotuned pick, the one-row column GEMV's tiles and pick (`w4a16_columns`, at M=1), and dense
bf16 `torch.matmul`) at the Llama-3-8B layer shapes, so a change to
the kernel or its candidates is judged on every tile. Two times per row:

- `eager`: a Python call per layer, as an eager decode makes them (launch overhead included);
- `graph`: the same calls replayed from one CUDA graph, as a compiled decode makes them (the
  kernel's own time, plus the zeroed split-K buffer and the cast it needs).

Each sweep calls the op on enough copies of the layer to exceed L2 (--sweep-mb), so weights come
from HBM. `err` is max |y - x @ W.T| / max (|x| @ |W|.T), W dequantized in fp32 by the
reference. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from quantkit.evals.common import run_main
from quantkit.evals.kernels.bench_w4a16 import SHAPE_SETS, _random_int4, copy_bandwidth
from quantkit.format.packing import dequantize_packed_int4
from quantkit.fused_kernels.packed_weights import PackedInt4
from quantkit.fused_kernels.triton.configs import (
    BlockConfig,
    clamp_block_k,
    gemv_block_m,
    gemv_configs,
    m_bucket,
)


def _median_us(run: Callable[[], None], calls: int, repeats: int = 7) -> float:
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def _graph_us(fn: Callable[[int], object], copies: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in range(copies):
            fn(c)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(copies):
            fn(c)
    return _median_us(graph.replay, copies)


def _time(fn: Callable[[int], object], copies: int) -> tuple[float, float]:
    eager = _median_us(lambda: [fn(c) for c in range(copies)], copies)
    return eager, _graph_us(fn, copies)


# Tiles tried beside the autotune candidates, to see whether the candidates should change:
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, UNPACK).
_EXTRA = [(16, 128, 2, 2, 4, 2), (16, 128, 4, 2, 4, 1), (8, 512, 0, 2, 1, 1),
          (16, 1024, 0, 4, 1, 1), (32, 1024, 0, 8, 1, 1), (16, 2048, 0, 8, 1, 1),
          (32, 256, 0, 4, 1, 1), (16, 512, 0, 4, 2, 1), (64, 512, 0, 8, 1, 1)]  # fmt: skip


def _configs(bucket: int, m: int, group: int, k: int) -> list[tuple[str, BlockConfig]]:
    import triton

    extra = [triton.Config({"BLOCK_N": n, "BLOCK_K": bk, "SPLIT_K": s, "UNPACK": u}, num_warps=w,
                           num_stages=st) for n, bk, s, w, st, u in _EXTRA]  # fmt: skip
    out = []
    for cfg in clamp_block_k(gemv_configs(bucket) + extra, {"GROUP_SIZE": group, "K": k}):
        kw = cfg.kwargs
        unpack, groups = kw.get("UNPACK", 0), kw.get("STEP_GROUPS", 1)
        name = (f"n{kw['BLOCK_N']} k{kw['BLOCK_K']} s{kw['SPLIT_K']} w{cfg.num_warps} "
                f"st{cfg.num_stages} u{unpack} g{groups}")  # fmt: skip
        out.append((name, BlockConfig(
            block_m=gemv_block_m(m), block_n=kw["BLOCK_N"], block_k=kw["BLOCK_K"],
            split_k=kw["SPLIT_K"], num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            unpack=unpack,
        )))  # fmt: skip
    return out


def _column_rows(packs: list[PackedInt4], x: torch.Tensor) -> list[tuple[str, Callable]]:
    """The triton layer's one-row path (`w4a16_columns`): each candidate tile with its SPLIT_K
    as autotune would size it, and the autotuned pick."""
    import triton

    from quantkit.fused_kernels.triton import w4a16_columns as wc

    cols = [wc.ColumnWords(p) for p in packs]
    named = dict(N=cols[0].out_features, K=cols[0].in_features, GROUP_SIZE=cols[0].group_size,
                 WORDS=cols[0].words.shape[0], x_ptr=x)  # fmt: skip
    rows = []
    for cfg in wc._fit(wc._configs(), named):
        kw = cfg.kwargs
        label = (f"cols n{kw['BLOCK_N']} w{kw['BLOCK_W']} s{kw['SPLIT_K']} w{cfg.num_warps} "
                 f"st{cfg.num_stages}")  # fmt: skip
        one = triton.Config(dict(kw), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        rows.append((label, lambda c, one=one: wc.columns_gemv(x, cols[c], config=one)))
    rows.append(("cols autotuned", lambda c: wc.columns_gemv(x, cols[c])))
    return rows


def _row(label: str, fn: Callable[[int], object], calls: int, nbytes: int, check) -> str:
    """One printed row: eager and graph microseconds per call, GB/s in the graph, error."""
    try:
        err = check(fn(0)) if check is not None else 0.0
        eager, graph = _time(fn, calls)
        return f"{label:<28} {eager:9.1f} {graph:9.1f} {nbytes / graph / 1e3:10.0f} {err:8.1e}"
    except Exception as e:  # one failing candidate must not hide the others
        return f"{label:<28} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _sweep_shape(
    name: str, n: int, k: int, ms: list[int], group: int, sweep_mb: float, tiles: bool
) -> None:
    from quantkit.fused_kernels.triton.w4a16 import w4a16_linear_triton

    dev = torch.device("cuda")
    per = n * k // 2 + n * (k // group) * 2 * 2
    copies = max(2, int(sweep_mb * 2**20 // per))
    layers = [_random_int4(n, k, group, dev, torch.bfloat16) for _ in range(copies)]
    packs = [PackedInt4(*t, k, group) for t in layers]
    wd = dequantize_packed_int4(*layers[0], in_features=k, group_size=group).float()
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(min(copies, 8))]
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ wd.T
        mag = (x.float().abs() @ wd.abs().T).max().item()

        def check(y: torch.Tensor, ref: torch.Tensor = ref, mag: float = mag) -> float:
            return (y.float() - ref).abs().max().item() / mag

        def int4(c: int, cfg: BlockConfig | None = None, x: torch.Tensor = x) -> torch.Tensor:
            return w4a16_linear_triton(x, packs[c], path="gemv", config=cfg, check=False)

        rows = [(label, functools.partial(int4, cfg=cfg)) for label, cfg in
                _configs(m_bucket(m), m, group, k) if tiles]  # fmt: skip
        rows.append(("autotuned", int4))
        if m == 1:
            rows += _column_rows(packs, x)
        for label, fn in rows:
            print(f"{name:<30} {m:>2} {_row(label, fn, copies, per, check)}", flush=True)
        fn = lambda c, x=x: x @ dense[c].T  # noqa: E731
        print(f"{name:<30} {m:>2} {_row('dense bf16 matmul', fn, len(dense), n * k * 2, None)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quantkit.evals.kernels.gemv_sweep")
    p.add_argument("--shapes", default="llama3-8b", choices=sorted(SHAPE_SETS))
    p.add_argument("--m", default="1,4", help="row counts (<= 16)")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--sweep-mb", type=float, default=256.0)
    p.add_argument(
        "--picks-only", action="store_true", help="time the autotuned picks and column tiles only"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_sweep: expected a CUDA GPU, got none")
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}; copy {copy:.0f} GB/s; group {args.group}")
    print(f"{'shape':<30} {'M':>2} {'impl':<28} {'eager us':>9} {'graph us':>9} "
          f"{'graph GB/s':>10} {'err':>8}")  # fmt: skip
    for name, n, k, _ in SHAPE_SETS[args.shapes]:
        ms = [int(m) for m in args.m.split(",")]
        _sweep_shape(name, n, k, ms, args.group, args.sweep_mb, not args.picks_only)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    run_main(main)
