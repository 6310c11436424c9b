"""Benchmark: FP8 E4M3 perplexity with round-to-nearest vs GPTQ rounding, over GPTQ settings.

    python -m quantkit.evals.studies.gptq_quality [--model smollm2-135m] [--eval-tokens 32768]
        [--w8a8] [--variant samples=64,damp=0.01,act_order=0,sequential=1 ...] [--json F]

Perplexity on the held-out Wikipedia split (window 512), computed once for the reference and
once per quantized model; a GPTQ variant's codes serve both W8A16 and W8A8 (the activations are
quantized only at run time), so `--w8a8` adds one evaluation per variant, not one quantization.
A benchmark, not a test: minutes per variant on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.evals.common import print_and_save, run_main
from quantkit.evals.studies.heldout import held_out, reference_ppl
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.quantize.calibration import calibration_samples, wiki_split
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import QuantizeOutcome, quantize_model

_KEYS = {"samples": int, "seq_len": int, "damp": float, "act_order": int, "sequential": int}


def parse_variant(text: str) -> dict[str, Any]:
    """'samples=64,damp=0.01,act_order=1' -> a dict (missing keys take the defaults)."""
    out: dict[str, Any] = {"samples": 64, "seq_len": 512, "damp": 0.01}
    out |= {"act_order": 0, "sequential": 1}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in _KEYS:
            raise SystemExit(f"--variant: expected keys {', '.join(_KEYS)}, got {key!r}")
        out[key] = _KEYS[key](value)
    return out


def _ppls(outcome: QuantizeOutcome, held, w8a8: bool) -> dict[str, float]:
    dense = build_model(outcome.config, outcome.dense_state())
    out = {"w8a16": perplexity(dense, held, window=512, progress=True).ppl}
    del dense
    if w8a8:
        dynamic = replace(outcome, scheme=replace(outcome.scheme, activations="dynamic"))
        out["w8a8"] = perplexity(dynamic.runtime_model(), held, window=512, progress=True).ppl
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = held_out(args.model, args.eval_tokens)
    model_dir, tok, held = data.model_dir, data.tokenizer, data.tokens
    results: dict[str, Any] = {"model": args.model, "eval_tokens": held.numel(), "window": 512}
    results["reference"] = reference_ppl(data)
    print(f"reference          ppl {results['reference']:.3f}", flush=True)
    t0 = time.perf_counter()
    rtn = quantize_model(model_dir, scheme=QuantScheme("fp8"))
    results["rtn"] = {"time_s": time.perf_counter() - t0, **_ppls(rtn, held, args.w8a8)}
    print(f"rtn                {results['rtn']}", flush=True)
    calib = wiki_split().calibration
    results["gptq"] = []
    for text in args.variant:
        v = parse_variant(text)

        def samples(v: dict[str, Any] = v):
            return calibration_samples(
                calib, tok, n_samples=v["samples"], seq_len=v["seq_len"], seed=0
            )

        cfg = GptqConfig(
            damp=v["damp"], act_order=bool(v["act_order"]), sequential=bool(v["sequential"])
        )
        t0 = time.perf_counter()
        out = quantize_model(
            model_dir, scheme=QuantScheme("fp8"), algorithm="gptq", samples=samples, gptq=cfg
        )
        row = {**v, "time_s": time.perf_counter() - t0, **_ppls(out, held, args.w8a8)}
        reductions = [r.loss_reduction for r in out.layer_reports]
        row["mean_layer_error_reduction"] = sum(reductions) / len(reductions)
        results["gptq"].append(row)
        print(f"gptq {text or 'defaults':<14}{row}", flush=True)
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def table(r: dict[str, Any]) -> str:
    ref = r["reference"]

    def cells(row: dict[str, Any]) -> str:
        parts = [f"{row['w8a16']:>8.3f} {row['w8a16'] / ref - 1:>+7.2%}"]
        if "w8a8" in row:
            parts.append(f"{row['w8a8']:>8.3f} {row['w8a8'] / ref - 1:>+7.2%}")
        return "  ".join(parts) + f"{row['time_s']:>8.0f}s"

    lines = [
        f"{r['model']}: FP8 E4M3 per-channel, perplexity on {r['eval_tokens']} held-out tokens "
        f"(window {r['window']}); reference {ref:.3f}",
        f"{'rounding':<40}{'W8A16':>16}  {'W8A8':>16}{'quantize':>9}",
        f"{'nearest (RTN)':<40}{cells(r['rtn'])}",
    ]
    for g in r["gptq"]:
        name = (
            f"gptq {g['samples']}x{g['seq_len']} damp {g['damp']:g}"
            f"{' act-order' if g['act_order'] else ''}{'' if g['sequential'] else ' 1-capture'}"
        )
        lines.append(f"{name:<40}{cells(g)}")
    lines.append(f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--w8a8", action="store_true", help="Also evaluate W8A8 (dynamic per-token).")
    p.add_argument("--variant", action="append", default=None, help="key=value,... (repeat)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.variant = args.variant or [""]
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
