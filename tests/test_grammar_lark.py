"""`--grammar FILE`: context-free grammars in Lark (llguidance's dialect) and llama.cpp's GBNF.

A SQL SELECT subset (Lark, conditions nested in parentheses) and arithmetic expressions (GBNF,
converted to Lark) constrain 50 samples each at temperature 1 over hand-made vocabularies and
random logits. Every sample is checked twice, by neither the matcher that constrained it nor
quantkit's code: a new llguidance matcher built here over the 256 single bytes, fed the
output's bytes, and a recursive-descent parser of the language written here. Then the CLI:
a Lark and a GBNF file end to end on the tiny model, and one line (exit 2, no traceback) for
each bad input; the time limit, deterministically (a check that cannot end before the limit).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import llguidance
import pytest
import torch

from quantkit.errors import GrammarError
from quantkit.grammar import cfg
from quantkit.grammar.cfg import lark_accepts, load_grammar_file
from quantkit.grammar.compiler import compile_grammar
from quantkit.grammar.constraints import lark_grammar
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.conftest import run_cli as run
from tests.hand_vocab import EOS, vocab_of
from tests.test_grammar_cli import generate_refuses

DATA = Path(__file__).resolve().parent / "data" / "grammars"
SELECT = DATA / "select.lark"
ARITHMETIC = DATA / "arithmetic.gbnf"
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("grammar_home")

# Pieces that cross the grammar's terminals ("e FR", ") OR (") as well as single characters.
SQL_PIECES = ["SELECT ", "SELECT", " FROM ", "FROM", " WHERE ", " AND ", " OR ", " ", "(", ")",
              "*", ", ", ",", "=", "<", ">", "'", *"abcdefghijklmnopqrstuvwxyz0123456789_",
              *"SELCTFROMWHAND", "id", "name", "age", "users", "1)", "=1", "e FR", "OM ",
              ") OR (", "'ab'"]  # fmt: skip
ARITHMETIC_PIECES = [*"0123456789+-*/(). ", "12", " + ", "(-", "0.", ") * (", "3)"]


# ----------------------------------------------------------------- the independent checks


class _Bytes:
    """The checking matcher's tokenizer: token b is the byte b, token 256 is EOS."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


_BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257)


def fresh_matcher_accepts(lark: str, data: bytes) -> bool:
    """A new llguidance matcher of `lark` (built here from the text, over single bytes) fed
    `data` one byte a token: accepted, and complete at the end."""
    matcher = llguidance.LLMatcher(
        _BYTE_TOKENIZER, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0
    )
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(data)) and matcher.is_accepting()


class _Cursor:
    """A position in a text, for the recursive-descent parsers below."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def eat(self, literal: str) -> bool:
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def match(self, pattern: str) -> bool:
        found = re.compile(pattern).match(self.text, self.at)
        if found:
            self.at = found.end()
        return found is not None


# Terminals of select.lark; a NAME or NUMBER is never followed by another of its characters.
_NAME = r"[a-z][a-z0-9_]{0,7}(?![a-z0-9_])"
_VALUE = rf"{_NAME}|[0-9]{{1,4}}(?![0-9])|'[a-z ]{{0,6}}'"


def sql_parses(text: str) -> bool:
    """select.lark's language: SELECT columns FROM name [WHERE condition]."""
    c = _Cursor(text)
    if not (c.eat("SELECT ") and _columns(c) and c.eat(" FROM ") and c.match(_NAME)):
        return False
    if c.eat(" WHERE ") and not _listed(c, _conjunction, " OR "):
        return False
    return c.at == len(text)


def _listed(c: _Cursor, item: Callable[[_Cursor], bool], separator: str) -> bool:
    """item (separator item)*"""
    if not item(c):
        return False
    while c.eat(separator):
        if not item(c):
            return False
    return True


def _columns(c: _Cursor) -> bool:
    return c.eat("*") or _listed(c, lambda c: c.match(_NAME), ", ")


def _conjunction(c: _Cursor) -> bool:
    return _listed(c, _atom, " AND ")


def _atom(c: _Cursor) -> bool:
    if c.eat("("):
        return _listed(c, _conjunction, " OR ") and c.eat(")")
    return c.match(_NAME) and c.match("[=<>]") and c.match(_VALUE)


def arithmetic_parses(text: str) -> bool:
    """arithmetic.gbnf's language, rule by rule."""
    c = _Cursor(text)
    return _expr(c) and c.at == len(text)


def _binary(c: _Cursor, operand: Callable[[_Cursor], bool], operators: str) -> bool:
    """operand (" "? OPERATOR " "? operand)*, giving the space back when no operator follows."""
    if not operand(c):
        return False
    while True:
        before = c.at
        c.eat(" ")
        if not c.match(operators):
            c.at = before
            return True
        c.eat(" ")
        if not operand(c):
            return False


def _expr(c: _Cursor) -> bool:
    return _binary(c, _term, "[-+]")


def _term(c: _Cursor) -> bool:
    return _binary(c, _factor, "[*/]")


def _factor(c: _Cursor) -> bool:
    if c.eat("("):
        return _expr(c) and c.eat(")")
    if c.eat("-"):
        return _factor(c)
    return c.match(r"[0-9]+(?:\.[0-9]+)?")


CASES = {
    "sql": (SELECT, SQL_PIECES, sql_parses),
    "gbnf-arithmetic": (ARITHMETIC, ARITHMETIC_PIECES, arithmetic_parses),
}
KNOWN = {
    "sql": (
        ["SELECT * FROM t", "SELECT a, b_2 FROM users WHERE (a=1 OR b<'x y') AND c>d",
         "SELECT a FROM t WHERE ((a=1))"],
        ["", "SELECT  FROM t", "SELECT a FROM t WHERE (a=1", "SELECT a FROM t WHERE a=12345",
         "SELECT a, FROM t", "select a from t", "SELECT a FROM t WHERE a=1 AND",
         "SELECT abcdefghi FROM t", "SELECT a FROM t WHERE a=b=c"],
    ),
    "gbnf-arithmetic": (
        ["1", "-(2.5 * 3)/4-1", "((1))", "1 - -2", "0.25*-3"],
        ["", "1.", "1 + ", "(1", "1  + 2", "1 ++ 2", "()", "-", "1 2", " 1"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_checks_agree_on_known_texts(case: str) -> None:
    """The two checks are not vacuous: both accept the valid texts and reject the near misses."""
    path, _, parses = CASES[case]
    grammar = load_grammar_file(path, timeout_s=10)
    assert grammar.kind == "lark" and grammar.label == f"grammar {path.name}"
    valid, invalid = KNOWN[case]
    for text in valid + invalid:
        expected = text in valid
        assert parses(text) is expected, text
        assert fresh_matcher_accepts(grammar.lark, text.encode()) is expected, text
        assert lark_accepts(grammar, text) is expected, text  # what `generate` checks with


def sample(compiled, rows: int, *, seed: int = 0, steps: int = 400) -> list[str]:
    """`rows` outputs sampled at temperature 1 from random logits through the processor. The
    EOS logit starts low and rises a little every step, so outputs grow past their first
    accepting state (nested conditions) and all of them end within `steps`."""
    vocab: TokenVocabulary = compiled.vocabulary
    processor = GrammarLogitsProcessor(compiled)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((rows, 1), 5)
    outs: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(steps):
        logits = torch.randn(rows, vocab.size, generator=gen) * 2
        logits[:, EOS[0]] += -4 + 0.1 * step
        masked = processor(ids, logits)
        token = torch.multinomial(masked.softmax(-1), 1, generator=gen).squeeze(1)
        for row in range(rows):
            if done[row]:
                token[row] = -1
            elif int(token[row]) in EOS:
                done[row] = True
            else:
                outs[row].append(int(token[row]))
        ids = torch.cat([ids, token[:, None]], 1)
        if all(done):
            break
    assert all(done), f"{done.count(False)} rows did not end within {steps} steps"
    return [b"".join(vocab.token_bytes[t] for t in out).decode() for out in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_fifty_samples_are_all_in_the_language(case: str) -> None:
    path, pieces, parses = CASES[case]
    grammar = load_grammar_file(path, timeout_s=10)
    compiled = compile_grammar(grammar, vocab_of(pieces), timeout_s=10)
    assert compiled.engine == "llguidance"  # auto: the only engine that takes a grammar
    texts = sample(compiled, 50)
    for text in texts:
        assert fresh_matcher_accepts(grammar.lark, text.encode()), text
        assert parses(text), text
    assert len(set(texts)) > 25, texts  # sampled, not one text again and again
    assert sum("(" in t for t in texts) >= 3, texts  # the nesting only a CFG has, exercised


def test_outlines_cannot_take_a_grammar_and_auto_picks_llguidance() -> None:
    grammar = lark_grammar('start: "a"+\n', label="grammar a.lark")
    vocab = vocab_of(["a", "aa"])
    with pytest.raises(GrammarError, match="--grammar-engine outlines: expected llguidance or"):
        compile_grammar(grammar, vocab, engine="outlines", timeout_s=10)
    assert compile_grammar(grammar, vocab, engine="auto", timeout_s=10).engine == "llguidance"
    # The check before the compile used the whole limit: the compile has none left.
    with pytest.raises(GrammarError, match=r"no time left .* limit of 1 s \(--compile-timeout"):
        compile_grammar(grammar, vocab, timeout_s=1.0, spent_s=1.5)


# ----------------------------------------------------------------- the time limit


@pytest.mark.parametrize(
    "name,stage,phase",
    [("big.gbnf", "gbnf_to_lark", "GBNF conversion"), ("big.lark", "check_syntax",
     "syntax check")],
)  # fmt: skip
def test_checking_a_grammar_is_bounded_by_the_compile_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, stage: str, phase: str
) -> None:
    """A conversion or check that cannot end before the limit (it waits for this test): the
    limit, not the work, ends the wait, in one line naming the phase."""
    release = threading.Event()
    real = getattr(cfg, stage)

    def held(*args: object) -> object:
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(cfg, stage, held)
    path = tmp_path / name
    path.write_text('root ::= "a"\n' if name.endswith(".gbnf") else 'start: "a"\n')
    try:
        with pytest.raises(GrammarError) as info:
            load_grammar_file(path, timeout_s=0.2)
    finally:
        release.set()
    assert str(info.value) == (
        f"--grammar {path}: checking it took longer than the limit of 0.2 s (--compile-timeout; "
        f"phase: {phase}); simplify the grammar or raise the limit"
    )


def test_a_long_chain_of_rules_does_not_overflow_the_stack(tmp_path: Path) -> None:
    """llguidance recurses once per chained rule: 3000 overflowed a thread's default stack (a
    segmentation fault). Run in a child, so a regression fails this test, not the whole run."""
    rules = "\n".join(f'r{i}: "w" r{i + 1}?' for i in range(6000))
    (tmp_path / "chain.lark").write_text(f'start: r0\n{rules}\nr6000: "end"\n')
    child = (
        "import sys; from quantkit.grammar.cfg import load_grammar_file; "
        "from quantkit.grammar.compiler import compile_grammar; "
        "from tests.hand_vocab import vocab_of; "
        "g = load_grammar_file(sys.argv[1], timeout_s=120); "
        "print(compile_grammar(g, vocab_of(['w', 'end']), timeout_s=120).engine)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "chain.lark")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "llguidance", proc


# ----------------------------------------------------------------- the CLI


@pytest.mark.parametrize(
    "name,text",
    [
        ("answer.lark", 'start: ("yes" | "no") ", " NAME "."\nNAME: /[a-z]{1,4}/\n'),
        ("answer.gbnf", '# llama.cpp style\nroot ::= ("yes" | "no") ", n=" digit digit?\n'
         "digit ::= [0-9]\n"),
    ],
    ids=["lark", "gbnf"],
)  # fmt: skip
def test_cli_generates_text_of_the_grammar(
    tiny_model_dir: Path, tmp_path: Path, capsys, name: str, text: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, out, err = run(
        capsys, "generate", str(tiny_model_dir), "--grammar", str(path), "--prompt", "Is it?",
        "--max-new-tokens", "24", "--json", "--output", str(tmp_path / "out.txt"),
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    assert summary["grammar_engine"] == "llguidance" and summary["output_valid"] is True
    assert summary["constraint"] == f"grammar {name}"
    grammar = load_grammar_file(path, timeout_s=10)
    assert fresh_matcher_accepts(grammar.lark, summary["text"].encode()), summary["text"]
    assert re.fullmatch(r"(yes|no), (n=[0-9]{1,2}|[a-z]{1,4}\.)", summary["text"])
    assert (tmp_path / "out.txt").read_text() == summary["text"] + "\n"


@pytest.mark.parametrize(
    "files,args,needles",
    [
        ({"bad.lark": 'start: "a" (\n'}, ["--grammar", "bad.lark"],
         ["error: --grammar bad.lark: llguidance cannot compile it: line 1 column"]),
        ({"bad.lark": 'start: "a" b\n'}, ["--grammar", "bad.lark"], ['unknown name: "b"']),
        ({"bad.lark": 'root ::= "a"\n'}, ["--grammar", "bad.lark"],
         ["this looks like GBNF: name the file *.gbnf"]),
        ({"bad.gbnf": 'root ::= "a" <[128001]>\n'}, ["--grammar", "bad.gbnf"],
         ["error: --grammar bad.gbnf: cannot convert GBNF to Lark: line 1: a token reference",
          "at `<[128001]>`"]),
        ({"bad.gbnf": 'root ::= item ("," item)*\n'}, ["--grammar", "bad.gbnf"],
         ["cannot convert GBNF to Lark: rule `item` is used but never defined"]),
        ({"bad.gbnf": 'expr ::= "1"\n'}, ["--grammar", "bad.gbnf"],
         ["expected a rule named `root`"]),
        ({"g.lark": 'start: "a"\n', "s.json": "{}"}, ["--grammar", "g.lark", "--schema", "s.json"],
         ["--schema and --grammar: expected at most one of --schema, --regex, --choice, "
          "--grammar, got 2"]),
        ({"g.lark": 'start: "a"\n'}, ["--grammar", "g.lark", "--grammar-engine", "outlines"],
         ["--grammar-engine outlines: expected llguidance or auto with --grammar"]),
        ({}, ["--grammar", "missing.lark"], ["--grammar missing.lark: cannot read it"]),
        ({"empty.lark": "\n"}, ["--grammar", "empty.lark"], ["got an empty file"]),
    ],
    ids=["lark-syntax", "lark-unknown-rule", "gbnf-named-lark", "gbnf-token-reference",
         "gbnf-undefined-rule", "gbnf-no-root", "with-schema", "outlines-engine", "missing",
         "empty"],
)  # fmt: skip
def test_bad_input_one_line_each(
    tiny_model_dir: Path, tmp_path: Path, capsys, monkeypatch, files, args, needles
) -> None:
    generate_refuses(
        tiny_model_dir, tmp_path, capsys, monkeypatch, files, ["--prompt", "x", *args], needles
    )


def test_cfg_eval_without_lark_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The eval's parser is a peer, never a dependency: missing, one line and exit 2, before
    any model loads (the grammar is not even read)."""
    from quantkit.evals.grammar import cfg as cfg_eval

    monkeypatch.setitem(sys.modules, "lark", None)  # `import lark` raises ImportError
    assert cfg_eval.main(["--grammar", str(SELECT), "--samples", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: the lark parser is not installed: pip install lark"
    assert cfg_eval.lark_text("%llguidance {}\nstart: A\n") == "\nstart: A\n"
