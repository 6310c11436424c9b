"""Benchmark: held-out perplexity of every weight format side by side, on the same tokens.

    python -m quantkit.evals.studies.format_quality [--model smollm2-135m] [--eval-tokens 16384]
        [--variants int4:awq int4:rtn fp8:gptq fp8:rtn int8:smoothquant nvfp4:rtn mxfp4:rtn ...]
        [--calib-samples N] [--json F]

A variant is FORMAT:ALGORITHM (a registered format and algorithm, `quantkit quantize --format`
and `--method`), each with its defaults: INT4 group size `auto` and asymmetric, the algorithm's
default calibration windows drawn with seed 0 from the calibration articles. Each model is run
as its checkpoint runs (`QuantizeOutcome.runtime_model`: the registry's kernels on this CPU), and
scored on the held-out Wikipedia articles (never used for calibration), window 512, beside the
unquantized reference. MB is the checkpoint's tensors (the embedding and lm_head stay dense in
every format). A benchmark, not a test: seconds to minutes
per variant on a 2-core CPU (AWQ and GPTQ the slowest).
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
from quantkit.format.formats import FORMATS
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.algorithms import ALGORITHMS, algorithm_for
from quantkit.quantize.calibration import calibration_samples, wiki_split
from quantkit.quantize.pipeline import quantize_model

DEFAULT_VARIANTS = (
    "int4:rtn",
    "int4:awq",
    "fp8:rtn",
    "fp8:gptq",
    "int8:rtn",
    "int8:smoothquant",
    "nvfp4:rtn",
    "mxfp4:rtn",
)


def parse_variant(text: str) -> tuple[QuantScheme, str]:
    """'nvfp4:gptq' -> (the format's default scheme, the algorithm), refused in one line."""
    fmt, _, algorithm = text.partition(":")
    if fmt not in FORMATS or algorithm not in ALGORITHMS:
        raise SystemExit(
            f"--variants: expected FORMAT:ALGORITHM with a format of {', '.join(FORMATS)} and an "
            f"algorithm of {', '.join(ALGORITHMS)}, got {text!r}"
        )
    scheme = QuantScheme(fmt)
    try:
        algorithm_for(algorithm, scheme)
    except Exception as e:  # noqa: BLE001 - one line, whatever the refusal
        raise SystemExit(f"--variants {text}: {e}") from None
    return scheme, algorithm


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = [(text, *parse_variant(text)) for text in args.variants]
    data = held_out(args.model, args.eval_tokens)
    model_dir, tok, held = data.model_dir, data.tokenizer, data.tokens
    results: dict[str, Any] = {"model": args.model, "eval_tokens": held.numel(), "window": 512}
    results["reference"] = reference_ppl(data)
    print(f"reference  ppl {results['reference']:.3f}", flush=True)
    calib = wiki_split().calibration
    results["variants"] = []
    for text, scheme, algorithm in variants:
        method = algorithm_for(algorithm, scheme)
        n = args.calib_samples or method.calib_samples

        def samples(n: int = n):
            return calibration_samples(calib, tok, n_samples=n, seq_len=512, seed=0)

        t0 = time.perf_counter()
        out = quantize_model(
            model_dir,
            scheme=scheme,
            algorithm=algorithm,
            samples=samples if method.calibrated else None,
        )
        elapsed = time.perf_counter() - t0
        ppl = perplexity(out.runtime_model(), held, window=512, progress=True).ppl
        row = {
            "variant": text,
            "scheme": out.scheme.describe(algorithm),
            "calib_samples": n if method.calibrated else 0,
            "time_s": elapsed,
            "mb": out.bytes_after / 1e6,
            "ppl": ppl,
        }
        results["variants"].append(row)
        print(f"{text:<18}{row}", flush=True)
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def table(r: dict[str, Any]) -> str:
    ref = r["reference"]
    lines = [
        f"{r['model']}: perplexity on {r['eval_tokens']} held-out tokens (window {r['window']}); "
        f"reference {ref:.3f}",
        f"{'variant':<18}{'scheme':<52}{'ppl':>8}{'vs ref':>9}{'MB':>8}{'quantize':>10}",
    ]
    for v in r["variants"]:
        lines.append(
            f"{v['variant']:<18}{v['scheme']:<52}{v['ppl']:>8.3f}{v['ppl'] / ref - 1:>+9.2%}"
            f"{v['mb']:>8.1f}{v['time_s']:>9.0f}s"
        )
    lines.append(f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    p.add_argument("--calib-samples", type=int, default=0, help="0 = each algorithm's default")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
