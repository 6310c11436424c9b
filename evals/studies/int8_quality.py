"""Benchmark: W8A8 INT8 perplexity with round to nearest vs SmoothQuant (and SmoothQuant then
GPTQ), over their settings.

    python -m quantkit.evals.studies.int8_quality [--model smollm2-135m] [--eval-tokens 32768]
        [--variant alpha=0.5,linear_prev=1,samples=64 ...] [--variant alpha=0.75,gptq=1 ...]
        [--json F]

A variant is SmoothQuant's settings (alpha, linear_prev), the calibration (samples, seq_len:
the algorithm's default windows when not given; seed) and the rounding: gptq=1 rounds the smoothed
layer with GPTQ (`smoothquant+gptq`; runtime=1 sums its Hessians over the inputs as the runtime
rounds them, sequential=1 after the layer's earlier groups were rounded, damp and act_order
as `GptqConfig`); smooth=0 leaves the smoothing out (with gptq=1: plain `gptq` on int8).

Perplexity on the held-out Wikipedia split (window 512) of the reference and of each W8A8 INT8
model as the checkpoint runs it (`QuantizeOutcome.runtime_model`: int8 weights, activations
rounded to int8 per token by the registry's kernel: the VNNI C kernel where the CPU has it, else
the exact reference; both compute the same bits). RTN is plain per-channel rounding with no
smoothing. Without --variant: SmoothQuant and SmoothQuant then GPTQ at their defaults. A
benchmark, not a test: on one thread of a 2-core CPU, 8 minutes for SmoothQuant with its 64
windows, 20 for SmoothQuant then GPTQ with 128.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path
from typing import Any

from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.evals.common import print_and_save, run_main
from quantkit.evals.studies.heldout import held_out, reference_ppl
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.algorithms import ALGORITHMS
from quantkit.quantize.calibration import calibration_samples, wiki_split
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import quantize_model
from quantkit.quantize.smoothquant import SmoothQuantConfig

DEFAULTS: dict[str, Any] = {
    "alpha": SmoothQuantConfig.alpha,
    "linear_prev": 1,
    "samples": 0,  # 0: the algorithm's default
    "seq_len": 512,
    "seed": 0,  # the calibration windows' draw
    "smooth": 1,
    "gptq": 0,
    "runtime": 1,
    "sequential": 0,
    "act_order": 1,
    "damp": 0.01,
}
INT8 = QuantScheme("int8")


def parse_variant(text: str) -> dict[str, Any]:
    """'alpha=0.5,linear_prev=0' -> a dict (missing keys take the defaults)."""
    out = dict(DEFAULTS)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"--variant: expected keys {', '.join(DEFAULTS)}, got {key!r}")
        out[key] = type(DEFAULTS[key])(value)
    if not out["smooth"] and not out["gptq"]:
        raise SystemExit("--variant: smooth=0 expected with gptq=1 (plain rounding is the rtn row)")
    return out


def algorithm(v: dict[str, Any]) -> str:
    if not v["smooth"]:
        return "gptq"
    return "smoothquant+gptq" if v["gptq"] else "smoothquant"


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
        method = algorithm(v)
        v["samples"] = v["samples"] or ALGORITHMS[method].calib_samples

        def samples(v: dict[str, Any] = v):
            return calibration_samples(
                calib, tok, n_samples=v["samples"], seq_len=v["seq_len"], seed=v["seed"]
            )

        cfg = SmoothQuantConfig(
            alpha=v["alpha"], linear_prev=bool(v["linear_prev"]), runtime_inputs=bool(v["runtime"])
        )
        gptq = GptqConfig(
            damp=v["damp"], act_order=bool(v["act_order"]), sequential=bool(v["sequential"])
        )
        t0 = time.perf_counter()
        out = quantize_model(
            model_dir,
            scheme=INT8,
            algorithm=method,
            samples=samples,
            smoothquant=cfg,
            gptq=gptq,
        )
        elapsed = time.perf_counter() - t0
        ppl = perplexity(out.runtime_model(), held, window=512, progress=True).ppl
        reductions = [r.loss_reduction for r in out.layer_reports]
        row = {**v, "method": method, "time_s": elapsed, "w8a8": ppl}
        row["mean_layer_error_reduction"] = sum(reductions) / len(reductions)
        results["smoothquant"].append(row)
        print(f"{method} {text or 'defaults':<14}{row}", flush=True)
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


NAME = 64  # the method column's width


def table(r: dict[str, Any]) -> str:
    ref = r["reference"]

    def cells(row: dict[str, Any]) -> str:
        return f"{row['w8a8']:>8.3f} {row['w8a8'] / ref - 1:>+7.2%}{row['time_s']:>9.0f}s"

    lines = [
        f"{r['model']}: INT8 W8A8 (per-channel weights, per-token activations), perplexity on "
        f"{r['eval_tokens']} held-out tokens (window {r['window']}); reference {ref:.3f}",
        f"{'method':<{NAME}}{'W8A8':>16}{'quantize':>10}",
        f"{'nearest (RTN), no smoothing':<{NAME}}{cells(r['rtn'])}",
    ]
    for s in r["smoothquant"]:
        lines.append(f"{variant_name(s):<{NAME}}{cells(s)}")
    lines.append(f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def variant_name(s: dict[str, Any]) -> str:
    """One row's label: the method, its settings that differ from the defaults, its
    calibration, and (smoothing) the mean layer W8A8 output error against RTN."""
    parts = [s["method"]]
    if s["smooth"]:
        parts.append(f"alpha {s['alpha']:g}{'' if s['linear_prev'] else ' norms only'}")
    if s["gptq"]:
        parts += [
            f"{k}={s[k]:g}"
            for k in ("runtime", "sequential", "act_order", "damp")
            if s[k] != DEFAULTS[k]
        ]
    parts.append(f"{s['samples']}x{s['seq_len']}" + (f" seed {s['seed']}" if s["seed"] else ""))
    if s["smooth"]:
        parts.append(f"(layer err {-s['mean_layer_error_reduction']:+.0%})")
    return " ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--variant", action="append", default=None, help="key=value,... (repeat)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.variant = args.variant or ["", "gptq=1"]  # SmoothQuant alone and then GPTQ
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
