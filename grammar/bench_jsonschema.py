"""JSONSchemaBench on the embedded model: coverage, soundness, validity, token limit, mask cost.

For a fixed sample of schemas across the benchmark's categories (`bench_data.sample_schemas`):

1. compile coverage: how many lower and compile within the time limit (and why the others not);
2. regex soundness: each test instance's compact JSON, tokenized by the model's tokenizer, is
   walked through the compiled index: valid ones should be accepted (completeness; the grammar
   may be narrower than the schema), invalid ones must be rejected (soundness);
3. generation: the model answers the default schema prompt greedily, up to --max-new-tokens,
   batched (one grammar per row). Outputs that finished (EOS in an accepting state) are parsed
   and validated with jsonschema: that share must be 100%. Outputs that hit the token limit
   are counted (goal: under 5%);
4. mask overhead: the processor's time per decode step (mean, p99) and its share of the step.

Usage: python -m quantkit.grammar.bench_jsonschema [--limit N] [--per-category K] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.errors import GrammarError
from quantkit.grammar.acceptance import accepts_tokens
from quantkit.grammar.bench_data import (
    PUBLISHED_GLAIVE,
    BenchSchema,
    classify_error,
    default_bench_dir,
    sample_schemas,
)
from quantkit.grammar.compiler import DEFAULT_TIMEOUT_S, CompiledGrammar, compile_grammar
from quantkit.grammar.constraints import json_schema_grammar, validate_json
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.prompting import default_schema_prompt
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["SchemaResult", "main", "run_bench"]

_MAX_TESTS = 10  # instances checked per schema and validity (keeps big schemas' runs short)


@dataclass
class SchemaResult:
    name: str
    category: str
    compiled: bool = False
    error: str | None = None
    error_kind: str | None = None
    compile_s: float = 0.0
    compile_source: str = ""
    valid_tests: int = 0
    valid_accepted: int = 0
    invalid_tests: int = 0
    invalid_rejected: int = 0
    finish: str | None = None  # "stop" or "length" once generated
    output_ok: bool | None = None  # finished outputs: parses and validates
    output_error: str | None = None
    output: str | None = None
    new_tokens: int = 0
    steered: bool = False  # the token budget steered the end (see grammar.budget)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _check_tests(
    result: SchemaResult, item: BenchSchema, compiled: CompiledGrammar, tok: Any
) -> None:
    for valid in (True, False):
        tests = [t for t in item.tests if bool(t.get("valid")) == valid][:_MAX_TESTS]
        for test in tests:
            ids = tok.encode(_compact(test["data"]), add_special_tokens=False)
            accepted = accepts_tokens(compiled, ids)
            if valid:
                result.valid_tests += 1
                result.valid_accepted += accepted
            else:
                result.invalid_tests += 1
                result.invalid_rejected += not accepted


def _generate_batch(
    loaded: Any,
    rows: list[tuple[SchemaResult, BenchSchema, CompiledGrammar]],
    *,
    max_new: int,
    eos: set[int],
) -> tuple[list[float], list[float]]:
    from quantkit.generate import encode_prompt, generate
    from quantkit.sampling import SamplingParams

    prompts = [
        encode_prompt(loaded.tokenizer, default_schema_prompt(item.schema, max_schema_chars=1500))
        for _, item, _ in rows
    ]
    processor = GrammarLogitsProcessor(
        [compiled for _, _, compiled in rows], max_new_tokens=max_new
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    out = generate(
        loaded.model,
        prompts,
        params,
        processors=[processor],
        eos_ids=eos,
        tokenizer=loaded.tokenizer,
    )
    for i, (result, item, _) in enumerate(rows):
        result.steered = i in processor.steered
        result.finish = out.finish_reasons[i]
        result.new_tokens = len(out.tokens[i])
        result.output = out.texts[i] if out.texts else None
        if result.finish == "stop":
            problem = validate_json(result.output or "", item.schema)
            result.output_ok = problem is None
            result.output_error = problem
    # The first processor call is part of prefill (TTFT); the rest pair with the decode steps.
    return processor.mask_times_s[1:], list(out.stats.decode_latencies_s)


def _load_model(spec: str | None) -> tuple[Any, str]:
    import torch

    from quantkit.embedded import embedded_int4_dir
    from quantkit.loader import load_model

    if spec is None:
        int4 = embedded_int4_dir()
        spec = str(int4) if (int4 / "config.json").is_file() else "smollm2-135m"
    loaded = load_model(spec, dtype=torch.float32)
    kind = "dense" if loaded.scheme is None else loaded.scheme.describe()
    return loaded, f"{loaded.path} ({kind})"


def run_bench(
    items: list[BenchSchema],
    *,
    model: str | None = None,
    generate_outputs: bool = True,
    max_new_tokens: int = 512,
    batch: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cache: bool = True,
    log: Any = print,
) -> dict[str, Any]:
    from quantkit.generate import eos_token_ids

    loaded, model_desc = _load_model(model)
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    vocab = TokenVocabulary.from_tokenizer(
        loaded.tokenizer, eos_token_ids=eos, vocab_size=loaded.config["vocab_size"]
    )
    results: list[SchemaResult] = []
    ready: list[tuple[SchemaResult, BenchSchema, CompiledGrammar]] = []
    mask_s: list[float] = []
    step_s: list[float] = []
    for n, item in enumerate(items, 1):
        result = SchemaResult(item.name, item.category)
        results.append(result)
        try:
            grammar = json_schema_grammar(item.schema, label=item.name)
            compiled = compile_grammar(grammar, vocab, timeout_s=timeout_s, cache=cache)
        except GrammarError as e:
            result.error, result.error_kind = str(e), classify_error(str(e))
            log(f"[{n}/{len(items)}] {item.name}: not compiled ({result.error_kind})")
            continue
        result.compiled, result.compile_s = True, compiled.compile_s
        result.compile_source = compiled.source
        _check_tests(result, item, compiled, loaded.tokenizer)
        took = f"{compiled.compile_s:.1f} s ({compiled.source})"
        log(f"[{n}/{len(items)}] {item.name}: index in {took}")
        if generate_outputs:
            ready.append((result, item, compiled))
            if len(ready) == batch:
                masks, steps = _generate_batch(loaded, ready, max_new=max_new_tokens, eos=eos)
                mask_s += masks
                step_s += steps
                for r, _, _ in ready:
                    log(f"    {r.name}: {r.finish}, {r.new_tokens} tokens, valid={r.output_ok}")
                ready = []
    if ready and generate_outputs:
        masks, steps = _generate_batch(loaded, ready, max_new=max_new_tokens, eos=eos)
        mask_s += masks
        step_s += steps
    return {
        "model": model_desc,
        "max_new_tokens": max_new_tokens,
        "batch": batch,
        "compile_timeout_s": timeout_s,
        "mask": _mask_summary(mask_s, step_s),
        "results": [asdict(r) for r in results],
    }


def _mask_summary(mask_s: list[float], step_s: list[float]) -> dict[str, float]:
    if not mask_s or not step_s:
        return {}
    mask = np.asarray(mask_s) * 1e6
    return {
        "steps": len(mask),
        "mean_us": float(mask.mean()),
        "p99_us": float(np.percentile(mask, 99)),
        "step_mean_ms": float(np.mean(step_s) * 1e3),
        "share": float(np.sum(mask_s) / np.sum(step_s)),
    }


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.1f}%)" if whole else "-"


def print_report(report: dict[str, Any]) -> None:
    results = [SchemaResult(**r) for r in report["results"]]
    print(f"\nmodel {report['model']}; greedy, up to {report['max_new_tokens']} new tokens, "
          f"batch {report['batch']}, compile limit {report['compile_timeout_s']:g} s")  # fmt: skip
    print(f"{'category':<16} {'n':>4} {'compiled':>9} {'finished valid':>15} {'hit limit':>10}")
    by_cat: dict[str, list[SchemaResult]] = defaultdict(list)
    for r in results:
        by_cat[r.category].append(r)
    for cat, rs in [*sorted(by_cat.items()), ("ALL", results)]:
        gen = [r for r in rs if r.finish is not None]
        fin = [r for r in gen if r.finish == "stop"]
        print(
            f"{cat:<16} {len(rs):>4} {sum(r.compiled for r in rs):>4} "
            f"({sum(r.compiled for r in rs) / len(rs):4.0%}) "
            f"{sum(bool(r.output_ok) for r in fin):>6}/{len(fin):<5} "
            f"{sum(r.finish == 'length' for r in gen):>6}/{len(gen)}"
        )
    gen = [r for r in results if r.finish is not None]
    fin = [r for r in gen if r.finish == "stop"]
    compiled = [r for r in results if r.compiled]
    print(f"\ncompile coverage      {_rate(len(compiled), len(results))}")
    glaive = by_cat.get("Glaiveai2K", [])
    if glaive:
        ours = sum(r.compiled for r in glaive) / len(glaive)
        published = ", ".join(f"{k} {v:.2f}" for k, v in PUBLISHED_GLAIVE.items())
        print(f"  Glaive coverage     {ours:.2f} (published compliance: {published})")
    causes: dict[str, int] = defaultdict(int)
    for r in results:
        if not r.compiled:
            causes[r.error_kind or "other"] += 1
    for cause, count in sorted(causes.items(), key=lambda kv: -kv[1]):
        print(f"  not compiled: {cause:<28} {count}")
    valid_t = sum(r.valid_tests for r in compiled)
    invalid_t = sum(r.invalid_tests for r in compiled)
    agree = sum(r.valid_accepted + r.invalid_rejected for r in compiled)
    rejected = sum(r.invalid_rejected for r in compiled)
    print(f"regex soundness       invalid rejected {_rate(rejected, invalid_t)}")
    accepted = sum(r.valid_accepted for r in compiled)
    print(f"  completeness        valid accepted {_rate(accepted, valid_t)}")
    print(f"  agreement           {_rate(agree, valid_t + invalid_t)}")
    print(f"finished outputs      valid {_rate(sum(bool(r.output_ok) for r in fin), len(fin))}")
    print(f"hit the token limit   {_rate(len(gen) - len(fin), len(gen))}")
    steered = sum(r.steered for r in gen)
    print(f"  steered to finish   {_rate(steered, len(gen))} (the budget closed the document)")
    for r in fin:
        if not r.output_ok:
            print(f"  INVALID {r.name}: {r.output_error}")
    mask = report.get("mask") or {}
    if mask:
        print(
            f"mask per decode step  mean {mask['mean_us']:.0f} us, p99 {mask['p99_us']:.0f} us "
            f"over {mask['steps']} steps = {mask['share']:.2%} of the step "
            f"(mean step {mask['step_mean_ms']:.1f} ms at batch {report['batch']})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantkit.grammar.bench_jsonschema")
    parser.add_argument("--data", type=Path, default=None, help="JSONSchemaBench root folder")
    parser.add_argument("--per-category", type=int, default=15)
    parser.add_argument("--limit", type=int, default=None, help="first N of the sample")
    parser.add_argument(
        "--model", default=None, help="default: embedded INT4 if cached, else dense"
    )
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="rows per generate call (a batch waits for its "
        "slowest row, so 1 is fastest when some rows run to the token limit)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--compile-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--no-generate", action="store_true", help="coverage and soundness only")
    parser.add_argument("--no-cache", action="store_true", help="compile every index afresh")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    folder = args.data or default_bench_dir()
    if not (folder / "maskbench" / "data").is_dir():
        print(f"error: expected JSONSchemaBench at {folder}, found nothing", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    items = sample_schemas(folder, per_category=args.per_category, limit=args.limit)
    started = time.perf_counter()
    report = run_bench(
        items,
        model=args.model,
        generate_outputs=not args.no_generate,
        max_new_tokens=args.max_new_tokens,
        batch=args.batch,
        timeout_s=args.compile_timeout,
        cache=not args.no_cache,
        log=lambda line: print(line, flush=True),
    )
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    print(f"\n{len(items)} schemas in {report['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
