"""Prefill tok/s of the embedded model: W8A8 INT8 against the INT4 default and the dense model.

    python -m quantkit.evals.speed.prefill [--tokens 512] [--repeats 5] [--dtype float32 ...]
        [--int4 CKPT] [--int8 CKPT] [--threads N] [--json F]

One prompt of --tokens held-out tokens, prefilled by `generate` (one new token, so the time is
the TTFT) with each model loaded as the CLI loads it (`RuntimeOptions.cli`, at each --dtype),
round-robin per repeat in this one process, so a noisy neighbour slows all of them. INT8 W8A8
multiplies int8 by int8 (`fused_kernels/cpu/int8`, vpdpbusd on CPUs with AVX512-VNNI; the exact
reference elsewhere, slowly); INT4 dequantizes row chunks for MKL / oneDNN at this length. The
INT8 checkpoint, unless given, is the embedded model rounded to nearest (the format's speed
does not depend on which algorithm chose the codes), written to a temporary directory.
Results never gate anything.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from quantkit.evals.common import git_commit, print_and_save, run_main


def _int8_checkpoint(model_dir: Path, into: Path) -> Path:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(model_dir, scheme=QuantScheme("int8"), algorithm="rtn")
    return outcome.save(into / "int8", source_dir=model_dir)


def _prefill_s(model: Any, ids: list[int]) -> float:
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    t0 = time.perf_counter()
    stats = generate(model, [ids], SamplingParams(max_new_tokens=1)).stats
    return stats.ttft_s if stats.ttft_s > 0 else time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from quantkit.cpu import cpu_name
    from quantkit.format.scheme import QuantScheme
    from quantkit.fused_kernels.kernel_registry import choose_kernel
    from quantkit.quantize.calibration import heldout_tokens
    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions
    from quantkit.sources.resolve import DEFAULT_MODEL, resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    dense_dir = resolve_model(DEFAULT_MODEL)
    ids = heldout_tokens(load_tokenizer(dense_dir), max_tokens=args.tokens).tolist()
    with tempfile.TemporaryDirectory(prefix="quantkit-prefill-") as tmp:
        paths = {
            "dense": dense_dir,
            "int4": args.int4 or ensure_embedded_int4(),
            "int8": args.int8 or _int8_checkpoint(dense_dir, Path(tmp)),
        }
        engines = []
        for dtype in args.dtype:
            options = RuntimeOptions.cli(dtype=dtype)
            for name in args.engines:
                loaded = load_model(paths[name], options=options, tokenizer=False)
                engines.append((name, dtype, loaded.describe(), loaded.model))
        times: dict[int, list[float]] = {i: [] for i in range(len(engines))}
        for *_, model in engines:  # warm up: kernel builds, weight layouts
            _prefill_s(model, ids)
        for _ in range(args.repeats):
            for i, (*_, model) in enumerate(engines):
                times[i].append(_prefill_s(model, ids))
    rows = []
    for i, (name, dtype, described, _) in enumerate(engines):
        secs = times[i]
        rows.append(
            {
                "engine": name,
                "dtype": dtype,
                "weights": described,
                "prefill_tok_s_median": len(ids) / statistics.median(secs),
                "prefill_tok_s_best": len(ids) / min(secs),
                "seconds": secs,
            }
        )
    return {
        "commit": git_commit(),
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
        "repeats": args.repeats,
        "int8_kernel": choose_kernel(QuantScheme("int8"), "cpu").name,
        "rows": rows,
    }


def table(r: dict[str, Any]) -> str:
    lines = [
        f"prefill of {r['prompt_tokens']} tokens, {r['cpu']}, {r['threads']} threads, "
        f"median of {r['repeats']} (int8 kernel: {r['int8_kernel']})",
        f"{'engine':<7}{'dtype':<10}{'tok/s':>9}{'best':>9}  weights",
    ]
    int4 = {
        row["dtype"]: row["prefill_tok_s_median"] for row in r["rows"] if row["engine"] == "int4"
    }
    for row in r["rows"]:
        ratio = ""
        if row["engine"] == "int8" and row["dtype"] in int4:
            ratio = f"  ({row['prefill_tok_s_median'] / int4[row['dtype']]:.2f}x int4)"
        lines.append(
            f"{row['engine']:<7}{row['dtype']:<10}{row['prefill_tok_s_median']:>9.0f}"
            f"{row['prefill_tok_s_best']:>9.0f}  {row['weights']}{ratio}"
        )
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="Prompt length.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--dtype", nargs="+", default=["float32"], choices=["auto", "float32", "bfloat16"]
    )
    p.add_argument(
        "--engines", nargs="+", default=["int8", "int4", "dense"], choices=["int8", "int4", "dense"]
    )
    p.add_argument("--int4", type=Path, help="INT4 checkpoint (default: the embedded one).")
    p.add_argument("--int8", type=Path, help="INT8 checkpoint (default: RTN of the embedded).")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
