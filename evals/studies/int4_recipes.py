"""Benchmark: which INT4 recipe closes the largest share of the RTN -> unquantized perplexity gap.

    python -m quantkit.evals.studies.int4_recipes --variants rtn awq gptq awq+gptq \\
        "gptq:clip=mse" "awq+gptq:samples=64,gptq.clip=output" [--seeds 0 1] \\
        [--eval-tokens 16384] [--group-size auto] [--baseline F] [--json F]

A variant is a registered algorithm (`quantkit.quantize.algorithms`), optionally with settings
after a colon: `samples=N` (calibration windows; default: the algorithm's), and any field of
`AwqConfig` or `GptqConfig` (`act_order=0`, `gptq.clip=output`, `awq.grid=10`; the prefix is
needed only where both have the field); awq+gptq also takes `candidates=awq+gptq/awq/gptq`, the
per-layer choice (`awq_gptq`). Every variant quantizes the same model in one process
with the same calibration draw per seed, and is scored on the same held-out Wikipedia tokens
(articles never used for calibration), window 512. `--baseline F` takes the unquantized and RTN
perplexities from an earlier run's JSON with the same model, tokens and group size instead of
measuring them again (minutes each on a 2-core CPU). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from quantkit.evals.common import print_and_save, run_main
from quantkit.evals.studies.heldout import earlier_baseline, held_out, reference_ppl
from quantkit.evals.studies.heldout import ppl as _ppl
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.quantize.algorithms import ALGORITHMS, Algorithm, QuantizeJob
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.awq_gptq import awq_gptq_walk
from quantkit.quantize.calibration import calibration_samples, wiki_split
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.layer_walk import LayerWalk
from quantkit.quantize.pipeline import quantize_model

CONFIGS: dict[str, type[AwqConfig] | type[GptqConfig]] = {"awq": AwqConfig, "gptq": GptqConfig}


def _value(text: str, like: Any) -> Any:
    """`text` as the type of a config field's default `like`."""
    if isinstance(like, bool):
        if text.lower() not in ("0", "1", "true", "false"):
            raise SystemExit(f"--variants: expected 0/1/true/false, got {text!r}")
        return text.lower() in ("1", "true")
    return type(like)(text)


def choice_algorithm(candidates: tuple[str, ...]) -> Algorithm:
    """awq+gptq keeping per layer the best of `candidates` (`awq_gptq.CANDIDATES`)."""
    base = ALGORITHMS["awq+gptq"]

    def walk(job: QuantizeJob) -> LayerWalk:
        assert job.samples is not None
        return awq_gptq_walk(
            job.model,
            job.samples,
            scheme=job.scheme,
            arch=job.arch,
            awq=job.awq,
            gptq=job.gptq,
            scale_dtype=job.storage_dtype,
            candidates=candidates,
        )

    name = f"{base.name}[{'/'.join(candidates)}]"
    return Algorithm(name, base.only, base.calib_samples, walk, base.configs)


def parse_variant(spec: str) -> dict[str, Any]:
    """'awq+gptq:samples=64,gptq.clip=output' -> {name, algorithm, samples, awq: {...},
    gptq: {...}} (settings not given take the configs' defaults). awq+gptq also takes
    `candidates=awq+gptq/awq/gptq`: the per-layer choice, registered for this run."""
    algorithm, _, rest = spec.partition(":")
    if algorithm not in ALGORITHMS:
        raise SystemExit(f"--variants: expected one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    uses = ALGORITHMS[algorithm].configs
    out: dict[str, Any] = {"name": spec, "algorithm": algorithm, "samples": None}
    out |= {c: {} for c in CONFIGS}
    for item in filter(None, rest.split(",")):
        key, _, text = item.partition("=")
        if key == "samples":
            out["samples"] = int(text)
            continue
        if key == "candidates" and algorithm == "awq+gptq":
            choice = choice_algorithm(tuple(text.split("/")))
            ALGORITHMS.setdefault(choice.name, choice)
            out["algorithm"] = choice.name
            continue
        section, _, field = key.rpartition(".")
        owners = [section] if section else [c for c in uses if _default(c, field) is not None]
        if len(owners) != 1 or owners[0] not in uses or _default(owners[0], field) is None:
            raise SystemExit(
                f"--variants {spec}: {key!r} is not a setting of {algorithm} "
                f"(it reads {', '.join(uses) or 'none'}; prefix awq. or gptq. where both have it)"
            )
        out[owners[0]][field] = _value(text, _default(owners[0], field))
    return out


def _default(section: str, field: str) -> Any:
    if section not in CONFIGS:
        return None
    defaults = {f.name: f.default for f in fields(CONFIGS[section])}
    return defaults.get(field)


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = [parse_variant(v) for v in args.variants]  # bad specs fail before any work
    data = held_out(args.model, args.eval_tokens)
    model_dir, tok, held = data.model_dir, data.tokenizer, data.tokens
    group = args.group_size if args.group_size == "auto" else int(args.group_size)
    scheme = QuantScheme("int4", group, args.symmetric)
    results: dict[str, Any] = {"model": args.model, "eval_tokens": held.numel(), "window": 512}
    rtn = quantize_model(model_dir, scheme=scheme)
    results["group_size"], results["symmetric"] = rtn.scheme.group_size, args.symmetric
    old = earlier_baseline(args.baseline, dict(results))
    if old is not None:
        results["reference"], results["rtn"] = old["reference"], old["rtn"]
    else:
        results["reference"] = reference_ppl(data)
        results["rtn"] = _ppl(build_model(rtn.config, rtn.dense_state()), held)
    del rtn
    print(f"reference ppl {results['reference']:.3f}, rtn {results['rtn']:.3f}", flush=True)
    calib = wiki_split().calibration
    results["rows"] = []
    for variant in variants:
        for seed in args.seeds if ALGORITHMS[variant["algorithm"]].calibrated else [None]:
            row = _quantized(variant, seed, model_dir, scheme, calib, tok, held, args)
            gap = results["rtn"] - results["reference"]
            row["gap_closed"] = (results["rtn"] - row["ppl"]) / gap
            results["rows"].append(row)
            print(
                f"{variant['name']} seed {seed}: ppl {row['ppl']:.3f}, gap closed "
                f"{row['gap_closed']:.1%}, quantize {row['quantize_s']:.0f} s",
                flush=True,
            )
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def _quantized(variant, seed, model_dir, scheme, calib, tok, held, args) -> dict[str, Any]:
    """One variant at one calibration seed (None: uncalibrated), quantized and scored."""
    algorithm = ALGORITHMS[variant["algorithm"]]
    n_samples = variant["samples"] or algorithm.calib_samples

    def samples():
        return calibration_samples(
            calib, tok, n_samples=n_samples, seq_len=args.calib_seq_len, seed=seed
        )

    t0 = time.perf_counter()
    out = quantize_model(
        model_dir,
        scheme=scheme,
        algorithm=algorithm.name,
        samples=samples if algorithm.calibrated else None,
        awq=AwqConfig(**{"seed": seed or 0, **variant["awq"]}),
        gptq=GptqConfig(**variant["gptq"]),
        on_layer=lambda r: print(
            f"  layer {r.index}: error vs RTN {-r.loss_reduction:+.0%} "
            f"{_choice(r)}({time.perf_counter() - t0:.0f} s)",
            flush=True,
        ),
    )
    elapsed = time.perf_counter() - t0
    return {
        "variant": variant["name"],
        "seed": seed,
        "calib_samples": n_samples if algorithm.calibrated else 0,
        "ppl": _ppl(build_model(out.config, out.dense_state()), held),
        "time_s": elapsed,
        "quantize_s": out.timings.get("quantize_s", elapsed),
        "timings": out.timings,
    }


def _choice(report: Any) -> str:
    """The candidate a per-layer choice kept, and each one's error relative to RTN's."""
    errors = getattr(report, "errors", {})
    if len(errors) < 2:
        return ""
    rtn = report.rtn_error or 1.0
    each = ", ".join(f"{k} {v / rtn - 1:+.0%}" for k, v in errors.items())
    return f"[{report.chosen}: {each}] "


def table(r: dict[str, Any]) -> str:
    kind = "symmetric" if r["symmetric"] else "asymmetric"
    lines = [
        f"{r['model']}: INT4 g{r['group_size']} {kind}, perplexity on {r['eval_tokens']} held-out "
        f"Wikipedia tokens (window {r['window']}); gap = RTN - unquantized",
        f"{'variant':<40}{'seed':>5}{'ppl':>9}{'gap closed':>12}{'quantize':>10}",
        f"{'unquantized':<40}{'':>5}{r['reference']:>9.3f}",
        f"{'rtn (baseline)':<40}{'':>5}{r['rtn']:>9.3f}{0:>11.1%}",
    ]
    for name in dict.fromkeys(row["variant"] for row in r["rows"]):
        rows = [row for row in r["rows"] if row["variant"] == name]
        for row in rows:
            seed = "-" if row["seed"] is None else str(row["seed"])
            lines.append(
                f"{name:<40}{seed:>5}{row['ppl']:>9.3f}{row['gap_closed']:>11.1%}"
                f"{row['quantize_s']:>9.0f}s"
            )
        if len(rows) > 1:
            closed = [row["gap_closed"] for row in rows]
            lines.append(
                f"{name + ' mean':<40}{'':>5}{statistics.mean(row['ppl'] for row in rows):>9.3f}"
                f"{statistics.mean(closed):>11.1%}  ({min(closed):.1%} .. {max(closed):.1%})"
            )
    lines.append(f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", nargs="+", default=["rtn", "awq", "gptq", "awq+gptq"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--group-size", default="auto")
    p.add_argument("--symmetric", action="store_true")
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--baseline", type=Path, help="reuse reference and RTN perplexity from a JSON")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
