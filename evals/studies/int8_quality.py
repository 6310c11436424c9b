"""Benchmark: W8A8 INT8 perplexity with round to nearest vs SmoothQuant, over its settings.

    python -m quantkit.evals.studies.int8_quality [--model smollm2-135m] [--eval-tokens 32768]
        [--variant alpha=0.5,linear_prev=1,samples=64 ...] [--json F]

Perplexity on the held-out Wikipedia split (window 512) of the reference and of each W8A8 INT8
model as the checkpoint runs it (`QuantizeOutcome.runtime_model`: int8 weights, activations
rounded to int8 per token by the registry's kernel: the VNNI C kernel where the CPU has it, else
the exact reference; both compute the same bits). RTN is plain per-channel rounding with no
smoothing. A benchmark, not a test: a minute or two per variant on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path
from typing import Any

from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.evals.common import print_and_save
from quantkit.evals.studies.heldout import held_out, reference_ppl
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.calibration import calibration_samples, wiki_split
from quantkit.quantize.pipeline import quantize_model
from quantkit.quantize.smoothquant import SmoothQuantConfig

_KEYS = {"alpha": float, "linear_prev": int, "samples": int, "seq_len": int}
INT8 = QuantScheme("int8")


def parse_variant(text: str) -> dict[str, Any]:
    """'alpha=0.5,linear_prev=0' -> a dict (missing keys take the defaults)."""
    out: dict[str, Any] = {"alpha": 0.5, "linear_prev": 1, "samples": 64, "seq_len": 512}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in _KEYS:
            raise SystemExit(f"--variant: expected keys {', '.join(_KEYS)}, got {key!r}")
        out[key] = _KEYS[key](value)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = held_out(args.model, args.eval_tokens)
    model_dir, tok, held = data.model_dir, data.tokenizer, data.tokens
    results: dict[str, Any] = {"model": args.model, "eval_tokens": held.numel(), "window": 512}
    results["reference"] = reference_ppl(data)
    print(f"reference          ppl {results['reference']:.3f}", flush=True)
    t0 = time.perf_counter()
    rtn = quantize_model(model_dir, scheme=INT8, algorithm="rtn")
    elapsed = time.perf_counter() - t0
    ppl = perplexity(rtn.runtime_model(), held, window=512, progress=True).ppl
    results["rtn"] = {"time_s": elapsed, "w8a8": ppl}
    print(f"rtn                {results['rtn']}", flush=True)
    calib = wiki_split().calibration
    results["smoothquant"] = []
    for text in args.variant:
        v = parse_variant(text)

        def samples(v: dict[str, Any] = v):
            return calibration_samples(
                calib, tok, n_samples=v["samples"], seq_len=v["seq_len"], seed=0
            )

        cfg = SmoothQuantConfig(alpha=v["alpha"], linear_prev=bool(v["linear_prev"]))
        t0 = time.perf_counter()
        out = quantize_model(
            model_dir, scheme=INT8, algorithm="smoothquant", samples=samples, smoothquant=cfg
        )
        elapsed = time.perf_counter() - t0
        ppl = perplexity(out.runtime_model(), held, window=512, progress=True).ppl
        reductions = [r.loss_reduction for r in out.layer_reports]
        row = {**v, "time_s": elapsed, "w8a8": ppl}
        row["mean_layer_error_reduction"] = sum(reductions) / len(reductions)
        results["smoothquant"].append(row)
        print(f"smoothquant {text or 'defaults':<14}{row}", flush=True)
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def table(r: dict[str, Any]) -> str:
    ref = r["reference"]

    def cells(row: dict[str, Any]) -> str:
        return f"{row['w8a8']:>8.3f} {row['w8a8'] / ref - 1:>+7.2%}{row['time_s']:>9.0f}s"

    lines = [
        f"{r['model']}: INT8 W8A8 (per-channel weights, per-token activations), perplexity on "
        f"{r['eval_tokens']} held-out tokens (window {r['window']}); reference {ref:.3f}",
        f"{'method':<44}{'W8A8':>16}{'quantize':>10}",
        f"{'nearest (RTN), no smoothing':<44}{cells(r['rtn'])}",
    ]
    for s in r["smoothquant"]:
        name = (
            f"smoothquant alpha {s['alpha']:g} {s['samples']}x{s['seq_len']}"
            f"{'' if s['linear_prev'] else ' norms only'}"
            f" (layer err {-s['mean_layer_error_reduction']:+.0%})"
        )
        lines.append(f"{name:<44}{cells(s)}")
    lines.append(f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--variant", action="append", default=None, help="key=value,... (repeat)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.variant = args.variant or [""]
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    main()
