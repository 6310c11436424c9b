"""A context-free grammar's samples, parsed by a parser that had no part in making them.

`--grammar FILE` (Lark in llguidance's dialect, or GBNF for a .gbnf file, converted and
checked exactly as `quantkit generate --grammar` does) constrains --samples outputs of the
model (default: the embedded INT4 model, as `generate` runs it) at temperature 1, in batches.
The `lark` package (Earley, dynamic lexer: every way to split the text into terminals is
tried) then parses every output that ended in an accepting state; the report is how many
parsed, how many ran into --max-new-tokens first (unfinished, not parsed), and each failure.

lark is a peer of this benchmark, never a dependency of quantkit: imported lazily, here only;
without it the script says `pip install lark` in one line and exits 2, before loading a model.
llguidance's dialect extends Lark's: its `%llguidance {...}` directive lines are dropped before
lark reads the grammar; a grammar lark still cannot read (llguidance's token references, lazy
or regex-extended rules) is one line, exit 2.

Exit status: 0 when every finished sample parsed, 1 when lark rejected one, 2 for bad input.

Usage: python -m quantkit.evals.grammar.cfg --grammar FILE [--samples 50] [--batch 25]
           [--max-new-tokens 128] [--prompt TEXT] [--seed 0] [--model M] [--threads N]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.evals.grammar.generate import load_model
from quantkit.grammar.cfg import load_grammar_file
from quantkit.grammar.compiler import DEFAULT_TIMEOUT_S, CompiledGrammar, compile_grammar
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.native_threads import exit_process
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["Sample", "lark_text", "main"]

EXIT_REJECTED = 1
EXIT_USAGE = 2
_PROMPT_GRAMMAR_CHARS = 1500  # the grammar quoted in the default prompt, at most


@dataclass(frozen=True)
class Sample:
    """One output: its text, why it ended ("stop": EOS in an accepting state; "length": the
    token limit came first) and, for a finished one, lark's reason to reject it (None: parsed)."""

    text: str
    finish: str
    problem: str | None = None

    @property
    def parsed(self) -> bool:
        return self.finish == "stop" and self.problem is None


def lark_text(lark: str) -> str:
    """`lark` as the lark package reads it: llguidance's `%llguidance` directive lines dropped
    (they configure llguidance's lexer; the language is the rules')."""
    return re.sub(r"(?m)^[ \t]*%llguidance\b.*$", "", lark)


def _import_lark() -> Any:
    try:
        import lark
    except ImportError:
        return None
    return lark


def _lark_parser(lark: Any, grammar: Grammar) -> Any:
    """An Earley parser of the grammar's `start` rule; QuantkitError naming the grammar when
    lark cannot read it."""
    assert grammar.lark is not None  # load_grammar_file returns Lark grammars
    try:
        return lark.Lark(lark_text(grammar.lark), start="start", parser="earley", lexer="dynamic")
    except lark.exceptions.LarkError as e:  # the grammar is llguidance's dialect beyond lark's
        reason = " ".join(str(e).split())[:300]
        raise QuantkitError(f"{grammar.label}: the lark package cannot read it: {reason}") from None


def _default_prompt(grammar: Grammar) -> str:
    assert grammar.lark is not None
    quoted = grammar.lark[:_PROMPT_GRAMMAR_CHARS]
    return f"Write one text in the language of this Lark grammar.\n\n{quoted}\n"


def _compiled(loaded: Any, grammar: Grammar, timeout_s: float, spent_s: float) -> CompiledGrammar:
    from quantkit.runtime.generate import eos_token_ids

    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    vocab = TokenVocabulary.from_tokenizer(
        loaded.tokenizer, eos_token_ids=eos, vocab_size=loaded.config.get("vocab_size")
    )
    return compile_grammar(grammar, vocab, timeout_s=timeout_s, spent_s=spent_s)


def _samples(loaded: Any, compiled: CompiledGrammar, args: argparse.Namespace) -> list[Sample]:
    """args.samples outputs at temperature 1, args.batch rows a generate call (seeds seed,
    seed + 1, ... per batch: reproducible, and no two batches alike)."""
    from quantkit.runtime.generate import encode_prompt, generate
    from quantkit.runtime.sampling import SamplingParams

    prompt = encode_prompt(loaded.tokenizer, args.prompt or _default_prompt(compiled.grammar))
    eos = set(compiled.vocabulary.eos_token_ids)
    out: list[Sample] = []
    for first in range(0, args.samples, args.batch):
        rows = min(args.batch, args.samples - first)
        params = SamplingParams(
            temperature=1.0,
            seed=args.seed + first // args.batch,
            max_new_tokens=args.max_new_tokens,
        )
        processor = GrammarLogitsProcessor(compiled, max_new_tokens=args.max_new_tokens)
        result = generate(
            loaded.model, [prompt] * rows, params, processors=[processor], eos_ids=eos,
            tokenizer=loaded.tokenizer,
        )  # fmt: skip
        out += [Sample(t, f) for t, f in zip(result.texts, result.finish_reasons, strict=True)]
        print(f"  {len(out)}/{args.samples} sampled", flush=True)
    return out


def _parsed(parser: Any, lark: Any, samples: list[Sample]) -> list[Sample]:
    """The samples with lark's verdict on each finished one."""
    out = []
    for sample in samples:
        problem = None
        if sample.finish == "stop":
            try:
                parser.parse(sample.text)
            except lark.exceptions.LarkError as e:
                problem = " ".join(str(e).split())[:200]
        out.append(Sample(sample.text, sample.finish, problem))
    return out


def _report(samples: list[Sample]) -> int:
    """Print every sample and the counts; the exit status (see the module docstring)."""
    for n, sample in enumerate(samples, 1):
        verdict = "parsed" if sample.parsed else sample.problem or "unfinished (token limit)"
        print(f"{n:3d} {verdict}: {sample.text[:120]!r}")
    finished = [s for s in samples if s.finish == "stop"]
    parsed = sum(s.parsed for s in samples)
    print(
        f"\nlark parsed {parsed}/{len(samples)} samples ({len(finished)} finished, "
        f"{len(samples) - len(finished)} stopped at --max-new-tokens unfinished, "
        f"{len(finished) - parsed} rejected)"
    )
    return 0 if parsed == len(finished) else EXIT_REJECTED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.cfg")
    parser.add_argument("--grammar", required=True, help="a Lark grammar file, or a .gbnf one")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--batch", type=int, default=25, help="rows per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt", default=None, help="default: asks for a text of the grammar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default=None, help="default: the embedded model as INT4, as `generate` runs it"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--compile-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.samples < 1 or args.batch < 1 or args.max_new_tokens < 1:
        print("error: --samples, --batch, --max-new-tokens: expected integers >= 1, got "
              f"{args.samples}, {args.batch}, {args.max_new_tokens}", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    lark = _import_lark()
    if lark is None:
        print("error: the lark parser is not installed: pip install lark", file=sys.stderr)
        return EXIT_USAGE
    try:
        started = time.perf_counter()
        grammar = load_grammar_file(args.grammar, timeout_s=args.compile_timeout)
        spent = time.perf_counter() - started
        parser = _lark_parser(lark, grammar)
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        loaded, described = load_model(args.model)
        print(f"model: {described}", flush=True)
        compiled = _compiled(loaded, grammar, args.compile_timeout, spent)
    except QuantkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{grammar.label}: {args.samples} samples at temperature 1", flush=True)
    return _report(_parsed(parser, lark, _samples(loaded, compiled, args)))


if __name__ == "__main__":
    # A build left running by --compile-timeout may still run: end without finalizing over it.
    exit_process(main())
