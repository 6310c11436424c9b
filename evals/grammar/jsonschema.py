"""JSONSchemaBench on the embedded model, per grammar engine: coverage, soundness, mask cost,
validity of finished outputs, token limit, fast-forward.

For a fixed sample of schemas across the benchmark's categories (`data.sample_schemas`),
each engine asked for (--engine, repeatable: auto, llguidance, outlines; default all three, on
the same schemas in one run):

1. compile coverage: how many compile within the time limit (every phase: lowering, index
   build, cache load), the compile time p50/p90, and why the others did not;
2. soundness: each test instance's compact JSON, tokenized by the model's tokenizer, is walked
   through a row of the compiled grammar: valid ones should be accepted (completeness),
   invalid ones must be rejected (soundness); every step's bitmask fill is timed (the
   engine's mask cost, mean and p99);
3. generation (first engine only): the model answers the default schema prompt greedily, up to
   --max-new-tokens, batched. Finished outputs (EOS in an accepting state) are validated with
   jsonschema: that share must be 100%; outputs that hit the token limit are counted; with
   batch 1 the tokens the grammar forces are fast-forwarded (share reported), and
   --compare-ff generates each output again without it (token identity, tok/s);
4. mask overhead in the decode loop: the processor's time per step and its share of the step;
5. cached recompile (outlines-core): each index loaded again from disk, as a second run would.

The report (`report`) gives each of these per category and in total, per engine, then one
comparison line per engine. With --json the report is rewritten (atomically) after every schema.

Usage: python -m quantkit.evals.grammar.jsonschema [--data DIR] [--engine E ...] [--limit N]
           [--per-category K] [--category NAME ...] [--no-generate] [--compare-ff] [--json F]
Ctrl-C ends it in one line (exit 130, as `quantkit`), naming the --json report written so far;
grammar builds left running by --compile-timeout do not crash its exit
(`quantkit.grammar.native_threads.exit_process`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError, GrammarError
from quantkit.evals.common import write_json_atomic
from quantkit.evals.grammar.data import (
    BenchSchema,
    classify_error,
    default_bench_dir,
    sample_schemas,
)
from quantkit.evals.grammar.generate import generate_batch, load_model, load_tokenizer
from quantkit.evals.grammar.report import (
    fill_summary,
    mask_summary,
    print_report,
    recompile_summary,
)
from quantkit.grammar.acceptance import accepts_tokens, timed_walk
from quantkit.grammar.compiler import (
    DEFAULT_TIMEOUT_S,
    ENGINES,
    CompiledGrammar,
    clear_memory_cache,
    compile_grammar,
)
from quantkit.grammar.constraints import schema_grammar
from quantkit.grammar.native_threads import exit_process
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
    engine: str = "auto"  # the engine asked for (--engine)
    engine_used: str | None = None  # the one that compiled it (auto: llguidance or outlines)
    notes: list[str] | None = None  # where the compiled grammar narrows the schema (warnings)
    forced_tokens: int = 0  # output tokens fed by fast-forward, without sampling
    unmasked_steps: int = 0  # greedy steps the rows' verdicts decided: no mask
    ff_identical: bool | None = None  # --compare-ff: same tokens with and without fast-forward
    tok_s: float | None = None  # decode tok/s of the generation (with fast-forward if on)
    tok_s_no_ff: float | None = None  # --compare-ff: the same generation without it


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _check_tests(
    result: SchemaResult,
    item: BenchSchema,
    compiled: CompiledGrammar,
    tok: Any,
    fill_s: list[float],
    mask_walks: int = 1,
) -> None:
    for valid in (True, False):
        tests = [t for t in item.tests if bool(t.get("valid")) == valid][:_MAX_TESTS]
        for test in tests:
            ids = tok.encode(_compact(test["data"]), add_special_tokens=False)
            if valid:  # the engine's mask fill, timed at every step of a valid document
                accepted = timed_walk(compiled, ids, fill_s, walks=mask_walks)
            else:
                accepted = accepts_tokens(compiled, ids)
            if valid:
                result.valid_tests += 1
                result.valid_accepted += accepted
            else:
                result.invalid_tests += 1
                result.invalid_rejected += not accepted


def _compile(
    item: BenchSchema, result: SchemaResult, vocab: TokenVocabulary, *, timeout_s: float,
    cache: bool,
) -> CompiledGrammar | None:  # fmt: skip
    """Compile `item` into `result` with its engine (lowering included for outlines-core);
    with the disk cache, time a second load of an outlines-core index."""
    try:
        grammar = schema_grammar(item.schema, label=item.name)
        compiled = compile_grammar(
            grammar, vocab, engine=result.engine, timeout_s=timeout_s, cache=cache
        )
    except GrammarError as e:
        result.error, result.error_kind = str(e), classify_error(str(e))
        return None
    result.compiled, result.compile_s = True, compiled.compile_s
    result.compile_source, result.engine_used = compiled.source, compiled.engine
    result.notes = list(compiled.notes)
    if cache and compiled.engine == "outlines":
        grammar = compiled.grammar  # lowered: a second run pays the lowering again, not timed
        # What a second run of this schema pays: the memory cache is gone, the disk one is not.
        clear_memory_cache()
        compiled = compile_grammar(
            grammar, vocab, engine="outlines", timeout_s=timeout_s, cache=True
        )
        result.recompile_s = compiled.compile_s
    return compiled


@dataclass(frozen=True)
class _Options:
    """What `run_bench` was asked to measure, and how (its keyword arguments)."""

    engines: tuple[str, ...]
    generate_outputs: bool
    max_new_tokens: int
    batch: int
    timeout_s: float
    cache: bool
    fast_forward: bool
    compare_ff: bool
    mask_walks: int


@dataclass
class _Bench:
    """One `run_bench` under way: the model (or its tokenizer) and vocabulary, the results so
    far, the rows waiting for a generate batch, and the timings."""

    opts: _Options
    loaded: Any
    model_desc: str
    eos: Any
    vocab: TokenVocabulary
    log: Any
    results: list[SchemaResult] = field(default_factory=list)
    ready: list[tuple[SchemaResult, BenchSchema, CompiledGrammar]] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    fill_s: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def start(cls, model: str | None, opts: _Options, log: Any) -> _Bench:
        from quantkit.runtime.generate import eos_token_ids

        loaded, model_desc = (load_model if opts.generate_outputs else load_tokenizer)(model)
        eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
        vocab = TokenVocabulary.from_tokenizer(
            loaded.tokenizer, eos_token_ids=eos, vocab_size=loaded.config["vocab_size"]
        )
        fill_s: dict[str, list[float]] = {e: [] for e in opts.engines}
        return cls(opts, loaded, model_desc, eos, vocab, log, fill_s=fill_s)

    def report(self) -> dict[str, Any]:
        opts = self.opts
        rows = [asdict(r) for r in self.results]
        return {
            "model": self.model_desc,
            "engines": list(opts.engines),
            "max_new_tokens": opts.max_new_tokens,
            "batch": opts.batch,
            "compile_timeout_s": opts.timeout_s,
            "generate": opts.generate_outputs,
            "fast_forward": opts.fast_forward,
            "mask": mask_summary(self.mask_s, self.step_s),
            "mask_fill": {e: fill_summary(f) for e, f in self.fill_s.items()},
            "mask_walks": opts.mask_walks,
            "recompile": recompile_summary(rows),
            "results": rows,
        }

    def flush(self) -> None:
        """Generate the outputs of the rows waiting (one batch) and log each."""
        opts = self.opts
        masks, steps = generate_batch(
            self.loaded, self.ready, max_new=opts.max_new_tokens, eos=self.eos,
            fast_forward=opts.fast_forward, compare_ff=opts.compare_ff,
        )  # fmt: skip
        self.mask_s.extend(masks)
        self.step_s.extend(steps)
        for r, _, _ in self.ready:
            self.log(f"    {r.name}: {r.finish}, {r.new_tokens} tokens ({r.forced_tokens} forced), "
                     f"valid={r.output_ok}, ff identical={r.ff_identical}")  # fmt: skip
        self.ready.clear()

    def measure(self, item: BenchSchema, *, at: str, started: float) -> None:
        """Every engine on `item`: compile, check its tests, queue it for generation (first
        engine only; a full batch is generated now). at: "[N/TOTAL", for the log lines."""
        opts = self.opts
        for engine in opts.engines:
            result = SchemaResult(item.name, item.category, engine=engine)
            self.results.append(result)
            compiled = _compile(
                item, result, self.vocab, timeout_s=opts.timeout_s, cache=opts.cache
            )
            where = f"{at} {time.perf_counter() - started:.0f} s] {engine}"
            if compiled is None:
                self.log(f"{where} {item.name}: not compiled ({result.error_kind})")
                continue
            _check_tests(
                result, item, compiled, self.loaded.tokenizer, self.fill_s[engine],
                opts.mask_walks,
            )  # fmt: skip
            self.log(f"{where} {item.name}: {result.engine_used} in "
                     f"{result.compile_s * 1e3:.1f} ms ({result.compile_source})")  # fmt: skip
            if opts.generate_outputs and engine == opts.engines[0]:
                self.ready.append((result, item, compiled))
                if len(self.ready) == opts.batch:
                    self.flush()


def run_bench(
    items: list[BenchSchema],
    *,
    model: str | None = None,
    engines: tuple[str, ...] = ("auto",),
    generate_outputs: bool = True,
    max_new_tokens: int = 512,
    batch: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cache: bool = True,
    fast_forward: bool = True,
    compare_ff: bool = False,
    mask_walks: int = 1,
    log: Any = print,
    checkpoint: Any = None,
) -> dict[str, Any]:
    """The benchmark over `items` (see the module docstring) for each of `engines` on the same
    schemas; outputs are generated with the first engine only. The report as a dict.
    checkpoint: called with the report so far after every schema (e.g. to save it)."""
    started = time.perf_counter()
    opts = _Options(
        engines, generate_outputs, max_new_tokens, batch, timeout_s, cache, fast_forward,
        compare_ff, mask_walks,
    )  # fmt: skip
    bench = _Bench.start(model, opts, log)
    for n, item in enumerate(items, 1):
        bench.measure(item, at=f"[{n}/{len(items)}", started=started)
        if checkpoint is not None:
            checkpoint(bench.report())
    if bench.ready:
        bench.flush()
    return bench.report()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.jsonschema")
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
    parser.add_argument(
        "--engine",
        action="append",
        choices=ENGINES,
        default=None,
        help="engine to measure (repeatable; default: auto, llguidance and outlines, each on "
        "the same schemas); outputs are generated with the first",
    )
    parser.add_argument(
        "--no-fast-forward", action="store_true", help="sample every token (batch 1 only)"
    )
    parser.add_argument(
        "--compare-ff",
        action="store_true",
        help="generate each output with and without fast-forward: token identity and tok/s",
    )
    parser.add_argument("--no-generate", action="store_true", help="coverage and soundness only")
    parser.add_argument("--no-cache", action="store_true", help="compile every index afresh")
    parser.add_argument(
        "--mask-walks",
        type=int,
        default=1,
        help="walk each valid instance K times (new rows of one compiled grammar); each step's "
        "fill time is the best of the K (5: the issue's best-of-5)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="write the report here (after every schema)"
    )
    return parser


def _items(args: argparse.Namespace) -> list[BenchSchema] | None:
    """The schemas `args` asks for, or None once the reason is printed (exit 2)."""
    try:
        folder = args.data or default_bench_dir()
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if not (folder / "maskbench" / "data").is_dir():
        print(f"error: expected JSONSchemaBench at {folder}, found nothing", file=sys.stderr)
        return None
    if args.mask_walks < 1:
        print(f"error: --mask-walks: expected an integer >= 1, got {args.mask_walks}",
              file=sys.stderr)  # fmt: skip
        return None
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    items = sample_schemas(
        folder, per_category=args.per_category, limit=args.limit, categories=args.category
    )
    if not items:
        print(f"error: expected schemas of categories {args.category}, found none", file=sys.stderr)
        return None
    return items


# The --json reports written in this process (the first save of each): what a Ctrl-C leaves.
_SAVED: list[Path] = []


def _saver(path: Path) -> Any:
    def save(report: dict[str, Any]) -> None:
        write_json_atomic(path, report)
        if path not in _SAVED:
            _SAVED.append(path)

    return save


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    items = _items(args)
    if items is None:
        return 2
    save = None if args.json is None else _saver(args.json)
    started = time.perf_counter()
    report = run_bench(
        items,
        model=args.model,
        engines=tuple(args.engine or ENGINES),
        generate_outputs=not args.no_generate,
        fast_forward=not args.no_fast_forward,
        compare_ff=args.compare_ff,
        mask_walks=args.mask_walks,
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


# ------------------------------------------------------------------ `python -m`: Ctrl-C, exit

EXIT_INTERRUPTED = 130  # as `quantkit` (quantkit.cli.main), which evals may not import


def _program() -> int:
    """`main` as a program: Ctrl-C answered as `quantkit` answers it, in one line (exit 130);
    the first SIGINT raises KeyboardInterrupt, every later one is ignored (SIG_IGN), so a
    second Ctrl-C cannot raise inside the answer, an `atexit` callback or the shutdown."""

    def interrupt_once(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # not started ignoring Ctrl-C
        signal.signal(signal.SIGINT, interrupt_once)
    try:
        return main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        saved = ", ".join(str(p) for p in _SAVED)
        print(f"interrupted; the report so far is in {saved}" if saved else
              "interrupted; nothing was written", file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what follows is the process's end


if __name__ == "__main__":
    # Builds that ran past --compile-timeout may still run: end without finalizing over them.
    exit_process(_program())
