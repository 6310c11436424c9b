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
4. mask overhead: the processor's time per decode step (mean, p99) and its share of the step;
5. cached recompile: with the disk cache on, each index is loaded again as a second run would
   (memory cache dropped), timed against the issue's 0.1 s.

The report (`bench_report`) gives each of these per category and in total, with declared and
empirical coverage beside the published GlaiveAI figures. With --json the report is rewritten
(atomically) after every schema, so an interrupted run keeps what it measured.

Usage: python -m quantkit.grammar.bench_jsonschema [--limit N] [--per-category K]
           [--category NAME ...] [--no-generate] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError, GrammarError
from quantkit.grammar.acceptance import accepts_tokens
from quantkit.grammar.bench_data import (
    BenchSchema,
    classify_error,
    default_bench_dir,
    sample_schemas,
)
from quantkit.grammar.bench_report import mask_summary, print_report, recompile_summary
from quantkit.grammar.cli_support import write_atomic
from quantkit.grammar.compiler import (
    DEFAULT_TIMEOUT_S,
    CompiledGrammar,
    clear_memory_cache,
    compile_grammar,
)
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
    recompile_s: float | None = None  # loading the cached index again (disk, as a second run)
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
    from quantkit.runtime.generate import encode_prompt, generate
    from quantkit.runtime.sampling import SamplingParams

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
    """The model as `quantkit generate` runs it: the embedded INT4 checkpoint by default
    (quantized once on first use), float32 activations, the same automatic lm_head dtype."""
    import torch

    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions

    options = RuntimeOptions(dtype="float32", head_dtype="auto")
    loaded = load_model(spec or ensure_embedded_int4(), options=options)
    kind = loaded.describe()
    head = str(loaded.model.lm_head.weight.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    return loaded, f"{loaded.path} ({kind}, lm_head {head}, {threads} torch threads)"


def _compile(
    item: BenchSchema, result: SchemaResult, vocab: TokenVocabulary, *, timeout_s: float,
    cache: bool,
) -> CompiledGrammar | None:  # fmt: skip
    """Lower and compile `item` into `result`; with the disk cache, time a second load."""
    try:
        grammar = json_schema_grammar(item.schema, label=item.name)
        compiled = compile_grammar(grammar, vocab, timeout_s=timeout_s, cache=cache)
    except GrammarError as e:
        result.error, result.error_kind = str(e), classify_error(str(e))
        return None
    result.compiled, result.compile_s = True, compiled.compile_s
    result.compile_source = compiled.source
    if cache:
        # What a second run of this schema pays: the memory cache is gone, the disk one is not.
        clear_memory_cache()
        compiled = compile_grammar(grammar, vocab, timeout_s=timeout_s, cache=True)
        result.recompile_s = compiled.compile_s
    return compiled


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
    checkpoint: Any = None,
) -> dict[str, Any]:
    """The benchmark over `items` (see the module docstring); the report as a dict.
    checkpoint: called with the report so far after every schema (e.g. to save it)."""
    from quantkit.runtime.generate import eos_token_ids

    started = time.perf_counter()
    loaded, model_desc = _load_model(model)
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    vocab = TokenVocabulary.from_tokenizer(
        loaded.tokenizer, eos_token_ids=eos, vocab_size=loaded.config["vocab_size"]
    )
    results: list[SchemaResult] = []
    ready: list[tuple[SchemaResult, BenchSchema, CompiledGrammar]] = []
    mask_s: list[float] = []
    step_s: list[float] = []

    def report() -> dict[str, Any]:
        rows = [asdict(r) for r in results]
        return {
            "model": model_desc,
            "max_new_tokens": max_new_tokens,
            "batch": batch,
            "compile_timeout_s": timeout_s,
            "generate": generate_outputs,
            "mask": mask_summary(mask_s, step_s),
            "recompile": recompile_summary(rows),
            "results": rows,
        }

    def flush() -> None:
        masks, steps = _generate_batch(loaded, ready, max_new=max_new_tokens, eos=eos)
        mask_s.extend(masks)
        step_s.extend(steps)
        for r, _, _ in ready:
            log(f"    {r.name}: {r.finish}, {r.new_tokens} tokens, valid={r.output_ok}")
        ready.clear()

    for n, item in enumerate(items, 1):
        result = SchemaResult(item.name, item.category)
        results.append(result)
        compiled = _compile(item, result, vocab, timeout_s=timeout_s, cache=cache)
        at = f"[{n}/{len(items)} {time.perf_counter() - started:.0f} s]"
        if compiled is None:
            log(f"{at} {item.name}: not compiled ({result.error_kind})")
        else:
            _check_tests(result, item, compiled, loaded.tokenizer)
            log(f"{at} {item.name}: index in {result.compile_s:.1f} s ({result.compile_source})")
            if generate_outputs:
                ready.append((result, item, compiled))
                if len(ready) == batch:
                    flush()
        if checkpoint is not None:
            checkpoint(report())
    if ready:
        flush()
    return report()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantkit.grammar.bench_jsonschema")
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="JSONSchemaBench root folder (default: $QUANTKIT_JSONSCHEMABENCH, else "
        "$QUANTKIT_DATA/jsonschemabench)",
    )
    parser.add_argument("--per-category", type=int, default=15)
    parser.add_argument(
        "--category", action="append", default=None, help="only this category (repeatable)"
    )
    parser.add_argument("--limit", type=int, default=None, help="first N of the sample")
    parser.add_argument(
        "--model", default=None, help="default: the embedded model as INT4, as `generate` runs it"
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
    parser.add_argument(
        "--json", type=Path, default=None, help="write the report here (after every schema)"
    )
    args = parser.parse_args(argv)
    try:
        folder = args.data or default_bench_dir()
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (folder / "maskbench" / "data").is_dir():
        print(f"error: expected JSONSchemaBench at {folder}, found nothing", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    items = sample_schemas(
        folder, per_category=args.per_category, limit=args.limit, categories=args.category
    )
    if not items:
        print(f"error: expected schemas of categories {args.category}, found none", file=sys.stderr)
        return 2
    save = None
    if args.json:
        path: Path = args.json
        save = lambda rep: write_atomic(path, json.dumps(rep, indent=1))  # noqa: E731
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
        checkpoint=save,
    )
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    print(f"\n{len(items)} schemas in {report['wall_s']:.0f} s")
    if save is not None:
        save(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
