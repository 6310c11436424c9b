"""What `quantkit generate --schema/--regex/--choice/--grammar` needs, kept out of the thin CLI
module.

The command calls, in order:

    run = GrammarRun.from_options(schema=..., regex=..., choices=..., grammar_file=...,
                                  compile_timeout=..., engine="auto")
    prompt = run.prompt(prompt)                  # the default prompt for a schema
    ... load the model ...
    processor = run.processor(loaded)            # compile (or load from cache), log to stderr
    ... generate(..., processors=[processor]) ...
    run.summary(result) / run.summary_lines(result)  # compile time, mask cost, validity
    run.finish(result, output=path)              # validate; write --output atomically

Every user mistake is a GrammarError (one line, non-zero exit through the CLI's handler), raised
before the model loads where possible: a --grammar file is read, converted from GBNF and its
syntax checked first, within --compile-timeout; the compile for the model's tokenizer gets the
rest of that limit.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import GenerationError, GrammarError
from quantkit.grammar.cfg import lark_accepts, load_grammar_file
from quantkit.grammar.compiler import (
    DEFAULT_ENGINE,
    DEFAULT_TIMEOUT_S,
    ENGINES,
    CompiledGrammar,
    compile_grammar,
)
from quantkit.grammar.constraints import (
    Grammar,
    choice_grammar,
    load_schema_file,
    regex_grammar,
    schema_grammar,
    validate_json,
)
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.prompting import default_schema_prompt
from quantkit.grammar.strict import strict_schema
from quantkit.grammar.vocabulary import TokenVocabulary
from quantkit.paths import atomic_file

# A day: longer is a typo (or `inf`, which no timer takes), not a wish.
MAX_TIMEOUT_S = 86400.0

__all__ = ["GrammarRun", "write_atomic"]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename, so the
    file is either the old one or the whole new one, never half written."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise GrammarError(f"--output {path}: expected an existing folder, got {folder}")
    with atomic_file(path) as tmp:
        tmp.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")


@dataclass
class GrammarRun:
    """One constrained generation from the CLI: the grammar, then its index and processor."""

    grammar: Grammar
    compile_timeout: float | None = DEFAULT_TIMEOUT_S
    log: Callable[[str], None] = _stderr
    engine: str = DEFAULT_ENGINE
    spent_s: float = 0.0  # of compile_timeout, used before the compile (a --grammar's check)
    # A tool-call grammar's own check of a finished output (`tool_run.ToolRequest.check`):
    # the calls parse and their arguments validate; None for every other grammar.
    checker: Callable[[str], str | None] | None = None
    compiled: CompiledGrammar | None = field(default=None, init=False)
    processor_: GrammarLogitsProcessor | None = field(default=None, init=False)

    @classmethod
    def from_options(
        cls,
        *,
        schema: str | Path | None = None,
        strict: bool = False,
        regex: str | None = None,
        choices: Sequence[str] = (),
        grammar_file: str | Path | None = None,
        compile_timeout: float | None = DEFAULT_TIMEOUT_S,
        log: Callable[[str], None] = _stderr,
        engine: str = DEFAULT_ENGINE,
    ) -> GrammarRun | None:
        """The run the options ask for, or None without a constraint. Checks everything that
        needs no model: one constraint at most, the engine, the schema file (against its
        metaschema; lowering it for outlines-core waits for the compile and its time limit),
        the regex's syntax, the grammar file (converted from GBNF, its syntax checked, within
        the compile time limit)."""
        if engine not in ENGINES:
            raise GrammarError(
                f"--grammar-engine: expected one of {', '.join(ENGINES)}, got {engine!r}"
            )
        options = (
            ("--schema", schema), ("--regex", regex), ("--choice", choices),
            ("--grammar", grammar_file),
        )  # fmt: skip
        given = [n for n, v in options if v]
        if len(given) > 1:
            raise GrammarError(
                f"{' and '.join(given)}: expected at most one of --schema, --regex, --choice, "
                f"--grammar, got {len(given)}"
            )
        if grammar_file and engine == "outlines":
            raise GrammarError(
                "--grammar-engine outlines: expected llguidance or auto with --grammar "
                "(outlines-core compiles regular expressions, not context-free grammars), got "
                "outlines"
            )
        if compile_timeout is not None and not 0 < compile_timeout <= MAX_TIMEOUT_S:
            raise GrammarError(
                f"--compile-timeout: expected seconds in (0, {MAX_TIMEOUT_S:g}], "
                f"got {compile_timeout}"
            )
        for flag, value in (("--schema", schema), ("--regex", regex), ("--grammar", grammar_file)):
            if value is not None and str(value) == "":
                # An empty constraint is a mistake, never "unconstrained" in disguise.
                raise GrammarError(f"{flag}: expected a non-empty value, got ''")
        if schema is not None:
            parsed = load_schema_file(schema)
            if strict:
                parsed = strict_schema(parsed)
            try:
                label = f"schema {Path(schema).name}" + (" (strict)" if strict else "")
                grammar = schema_grammar(parsed, label=label)
            except GrammarError as e:
                raise GrammarError(f"--schema {schema}: {e}") from None
        elif regex is not None:
            grammar = regex_grammar(regex)
        elif choices:
            grammar = choice_grammar(choices)
        elif grammar_file is not None:
            started = time.perf_counter()
            grammar = load_grammar_file(grammar_file, timeout_s=compile_timeout)
            spent = time.perf_counter() - started
            return cls(
                grammar, compile_timeout=compile_timeout, log=log, engine=engine, spent_s=spent
            )
        else:
            return None
        return cls(grammar, compile_timeout=compile_timeout, log=log, engine=engine)

    def prompt(self, prompt: str | None) -> str:
        """`prompt`, or for a schema without one the default prompt (title, description)."""
        if prompt is not None:
            return prompt
        if self.grammar.kind == "json_schema":
            return default_schema_prompt(self.grammar.schema)
        raise GenerationError(f"--prompt: expected a prompt with {self.grammar.label}, got none")

    def processor(
        self,
        loaded: Any,
        *,
        eos_ids: set[int],
        max_new_tokens: int | None = None,
        greedy: bool = False,
    ) -> GrammarLogitsProcessor:
        """Compile (or load) the index for the loaded model's tokenizer; a new processor, which
        steers the output to completion within max_new_tokens when given (see `budget`), and
        leaves a greedy step unmasked where the grammar allows its best token (`greedy`: the
        tokens are sampled by arg-max)."""
        vocab = TokenVocabulary.from_tokenizer(
            loaded.tokenizer, eos_token_ids=eos_ids, vocab_size=loaded.config.get("vocab_size")
        )
        if self.compiled is None or self.compiled.vocabulary.fingerprint != vocab.fingerprint:
            limit = "none" if self.compile_timeout is None else f"{self.compile_timeout:g} s"
            self.log(f"compiling {self.grammar.label} (engine {self.engine}, limit {limit}) ...")
            self.compiled = compile_grammar(
                self.grammar, vocab, engine=self.engine, timeout_s=self.compile_timeout,
                spent_s=self.spent_s,
            )  # fmt: skip
            for note in self.compiled.notes:  # never narrowed silently
                if self.grammar.kind == "json_schema":
                    self.log(f"warning: {self.compiled.engine} narrows the schema: {note}")
                else:  # llguidance's warnings about a grammar (it narrows none)
                    self.log(f"warning: {note}")
        self.processor_ = GrammarLogitsProcessor(
            self.compiled, max_new_tokens=max_new_tokens, greedy=greedy
        )
        return self.processor_

    def check(self, text: str, finish_reason: str) -> str | None:
        """None if `text` is a complete, valid output; else why not (one line)."""
        if finish_reason != "stop":
            return "incomplete: the token limit came before the grammar was complete"
        if self.checker is not None:
            return self.checker(text)
        if self.grammar.kind == "json_schema":
            problem = validate_json(text, self.grammar.schema)
            return None if problem is None else f"does not validate: {problem}"
        if self.grammar.kind == "lark":
            return None if lark_accepts(self.grammar, text) else f"not in {self.grammar.label}"
        if re.fullmatch(self.grammar.regex or "", text) is None:
            return f"does not match {self.grammar.label}"
        return None

    def summary(
        self, text: str, finish_reason: str, decode_latencies_s: Sequence[float]
    ) -> dict[str, Any]:
        """Machine-readable fields for --json (and for `summary_lines`)."""
        assert self.compiled is not None and self.processor_ is not None  # processor() ran
        stats = self.processor_.mask_stats()
        steps = list(decode_latencies_s)
        share = None
        if steps and stats["calls"] > 1:
            # The first call masks the prefill's logits (part of TTFT); the rest pair with steps.
            mask_s = sum(self.processor_.mask_times_s[1:])
            share = mask_s / sum(steps)
        problem = self.check(text, finish_reason)
        forced = self.processor_.forced_count
        return {
            "constraint": self.grammar.label,
            "grammar_engine": self.compiled.engine,
            "grammar_engine_requested": self.engine,
            "engines_refused": list(self.compiled.tried),
            "fast_forward_tokens": forced,
            "fast_forward_share": forced / max(self.processor_.token_count, 1),
            "compile_s": self.compiled.compile_s,
            "compile_source": self.compiled.source,
            "mask_mean_us": stats["mean_us"],
            "mask_p99_us": stats["p99_us"],
            "mask_share": share,
            "mask_skipped_steps": self.processor_.unmasked,
            "mask_steps": stats["calls"],
            "budget_steered": bool(self.processor_.steered),
            "output_valid": problem is None,
            "output_problem": problem,
            "grammar_notes": list(self.compiled.notes),
        }

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """The lines the command adds to its summary block."""
        cached = {
            "memory": " (from the in-process cache)",
            "disk": " (from the disk cache, not recompiled)",
            "compiled": " (compiled now; cached for the next run)",
        }.get(summary["compile_source"], "")
        if summary["grammar_engine"] == "llguidance":
            cached = ""  # compiled in milliseconds every run: nothing cached on disk
        engine = summary["grammar_engine"]
        how = "" if summary["grammar_engine_requested"] == engine else " (auto)"
        lines = [
            f"grammar    {summary['constraint']}: engine {engine}{how}, compiled in "
            f"{summary['compile_s'] * 1e3:.1f} ms{cached}"
        ]
        if summary["fast_forward_tokens"]:
            lines.append(
                f"forced     {summary['fast_forward_tokens']} tokens fast-forwarded "
                f"({summary['fast_forward_share']:.0%} of the output, fed without sampling)"
            )
        share = summary["mask_share"]
        share_text = "" if share is None else f" = {share:.2%} of the decode step"
        lines.append(
            f"mask       mean {summary['mask_mean_us']:.0f} us, p99 "
            f"{summary['mask_p99_us']:.0f} us per token{share_text} (advances included)"
        )
        if summary["mask_skipped_steps"]:
            lines.append(
                f"unmasked   {summary['mask_skipped_steps']} of {summary['mask_steps']} steps: "
                f"greedy, and the grammar told which of the model's best tokens it allows"
            )
        if summary["budget_steered"]:
            lines.append("budget     steered to finish within --max-new-tokens (byte by byte)")
        notes = summary["grammar_notes"]
        tag = "narrowed   " if self.grammar.kind == "json_schema" else "warning    "
        for note in notes[:3]:
            lines.append(f"{tag}{note}")
        if len(notes) > 3:
            lines.append(f"{tag}... and {len(notes) - 3} more (see --json)")
        verdict = "valid" if summary["output_valid"] else summary["output_problem"]
        what = "JSON, matches the schema" if self.grammar.kind == "json_schema" else "matches"
        lines.append(f"output     {what}" if summary["output_valid"] else f"output     {verdict}")
        return lines

    def finish(self, text: str, finish_reason: str, *, output: Path | None = None) -> None:
        """Write --output (only a complete, valid output); GrammarError otherwise."""
        problem = self.check(text, finish_reason)
        if problem is not None:
            hint = " (raise --max-new-tokens)" if finish_reason != "stop" else ""
            raise GrammarError(f"output {problem}{hint}")
        if output is not None:
            write_atomic(Path(output), text)
