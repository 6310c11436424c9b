"""Benchmark: how much of the RTN -> unquantized perplexity gap AWQ (and GPTQ) close for INT4,
over several seeds.

    python -m quantkit.evals.studies.awq_quality [--model smollm2-135m] [--seeds 0 1 2]
        [--eval-tokens 32768] [--group-size auto] [--calib-samples 64] [--search-tokens 4096]
        [--methods awq gptq] [--gptq-calib-samples 128]

Perplexity is measured on the held-out Wikipedia split (articles never used for calibration),
window 512; each seed redraws the calibration windows. Prints one table and, with --json, writes
every number. A benchmark, not a test: it takes minutes per seed on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

from quantkit.evals.common import print_and_save, run_main
from quantkit.evals.studies.heldout import held_out, reference_ppl
from quantkit.evals.studies.heldout import ppl as _ppl
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.quantize.algorithms import DEFAULT_CALIB_SAMPLES, GPTQ_CALIB_SAMPLES
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.calibration import calibration_samples, wiki_split
from quantkit.quantize.pipeline import quantize_model


def run(args: argparse.Namespace) -> dict:
    data = held_out(args.model, args.eval_tokens)
    model_dir, tok, held = data.model_dir, data.tokenizer, data.tokens
    group = args.group_size if args.group_size == "auto" else int(args.group_size)
    results: dict = {"model": args.model, "eval_tokens": held.numel(), "window": 512}
    results["reference"] = reference_ppl(data)
    print(f"reference  ppl {results['reference']:.3f}", flush=True)

    rtn = quantize_model(model_dir, scheme=QuantScheme("int4", group))
    results["group_size"] = rtn.scheme.group_size
    results["rtn"] = _ppl(build_model(rtn.config, rtn.dense_state()), held)
    print(f"rtn        ppl {results['rtn']:.3f}", flush=True)

    calib = wiki_split().calibration
    results["awq"] = []
    for method in args.methods:
        n_samples = args.calib_samples if method == "awq" else args.gptq_calib_samples
        for seed in args.seeds:
            row = _calibrated(args, method, seed, model_dir, calib, tok, n_samples, group, held)
            closed = (results["rtn"] - row["ppl"]) / (results["rtn"] - results["reference"])
            row["gap_closed"] = closed
            results["awq"].append(row)
            print(
                f"{method} seed {seed} ppl {row['ppl']:.3f}  gap closed {closed:.1%}  "
                f"({row['time_s']:.0f} s)",
                flush=True,
            )
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def _calibrated(args, method, seed, model_dir, calib, tok, n_samples, group, held) -> dict:
    """One calibrated quantization (awq or gptq) at one calibration seed, scored."""

    def samples():
        return calibration_samples(
            calib, tok, n_samples=n_samples, seq_len=args.calib_seq_len, seed=seed
        )

    t0 = time.perf_counter()
    cfg = AwqConfig(
        search_tokens=args.search_tokens,
        seed=seed,
        grid=args.grid,
        duo_scaling=not args.no_duo,
        clip=not args.no_clip,
    )
    out = quantize_model(
        model_dir,
        scheme=QuantScheme("int4", group),
        algorithm=method,
        samples=samples,
        awq=cfg,
    )
    elapsed = time.perf_counter() - t0
    ppl = _ppl(build_model(out.config, out.dense_state()), held)
    return {
        "method": method,
        "seed": seed,
        "calib_samples": n_samples,
        "ppl": ppl,
        "time_s": elapsed,
        "timings": out.timings,
    }


def table(r: dict) -> str:
    lines = [
        f"{r['model']}: INT4 g{r['group_size']}, perplexity on {r['eval_tokens']} held-out "
        f"Wikipedia tokens (window {r['window']})",
        f"{'model':<22}{'ppl':>10}{'gap closed':>14}{'time':>10}",
        f"{'unquantized':<22}{r['reference']:>10.3f}",
        f"{'RTN':<22}{r['rtn']:>10.3f}{0:>13.0%}",
    ]
    for method in dict.fromkeys(a.get("method", "awq") for a in r["awq"]):
        rows = [a for a in r["awq"] if a.get("method", "awq") == method]
        name = method.upper()
        for a in rows:
            lines.append(
                f"{name + ' seed ' + str(a['seed']):<22}{a['ppl']:>10.3f}"
                f"{a['gap_closed']:>13.1%}{a['time_s']:>9.0f}s"
            )
        closed, ppls = [a["gap_closed"] for a in rows], [a["ppl"] for a in rows]
        if len(closed) > 1:
            lines.append(
                f"{name + ' mean (min..max)':<22}{statistics.mean(ppls):>10.3f}"
                f"{statistics.mean(closed):>13.1%}  ({min(closed):.1%} .. {max(closed):.1%})"
            )
    lines.append("AWQ paper, Llama-2-7B g128: fp16 5.47, RTN 5.73, AWQ 5.60 (50% of the gap)")
    lines.append(f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--group-size", default="auto")
    p.add_argument("--calib-samples", type=int, default=DEFAULT_CALIB_SAMPLES)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--search-tokens", type=int, default=4096)
    p.add_argument("--grid", type=int, default=20)
    p.add_argument("--no-duo", action="store_true")
    p.add_argument("--no-clip", action="store_true")
    p.add_argument("--methods", nargs="+", choices=["awq", "gptq"], default=["awq"])
    p.add_argument("--gptq-calib-samples", type=int, default=GPTQ_CALIB_SAMPLES)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
