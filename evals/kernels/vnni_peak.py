"""The int8 dot-product peak of this CPU.

    python -m quantkit.evals.kernels.vnni_peak [--threads 1 2] [--repeats 5]

Runs the C micro-benchmark `qk_int8_peak_ops` (`fused_kernels/cpu/csrc/int8.c`: independent
512-bit vpdpbusd chains, nothing else) and prints int8 GOPS (a product and its add count 2) at
each thread count, the best of --repeats runs. It is the ceiling the prefill's int8 tiles are
held to (`quantkit.evals.speed.prefill_tops`). Needs AVX512-VNNI; elsewhere it says so and
exits 2.
"""

from __future__ import annotations

import argparse
import time

from quantkit.cpu import cpu_name
from quantkit.evals.common import run_main


def peak_gops(threads: int, *, repeats: int = 5, rounds: int = 4_000_000) -> float:
    """The best of `repeats` timed runs, in int8 GOPS; 0.0 where the build has no VNNI."""
    from quantkit.fused_kernels.cpu.int8 import _library

    lib = _library()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops = lib.qk_int8_peak_ops(rounds, threads)
        dt = time.perf_counter() - t0
        if ops == 0:
            return 0.0
        best = max(best, ops / dt / 1e9)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.threads) < 1:
        p.error(f"--threads: expected counts >= 1, got {args.threads}")
    print(f"vpdpbusd peak on {cpu_name()} (best of {args.repeats})")
    for n in args.threads:
        gops = peak_gops(n, repeats=args.repeats)
        if gops == 0.0:
            print("no AVX512-VNNI in this CPU's kernel build: no int8 peak to measure")
            return 2
        print(f"  {n} thread{'s' if n > 1 else ''}: {gops:8.0f} int8 GOPS")
    return 0


if __name__ == "__main__":
    run_main(main)
