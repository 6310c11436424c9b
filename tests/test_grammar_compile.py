"""Index compilation: disk and memory cache, the time limit, compile errors, missing extra."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import pytest

from quantkit.errors import GrammarError, MissingExtraError
from quantkit.grammar import compiler, worker_client
from quantkit.grammar.compiler import compile_grammar, grammar_cache_dir
from quantkit.grammar.constraints import (
    choice_grammar,
    json_schema_grammar,
    load_schema_file,
    regex_grammar,
)
from quantkit.grammar.vocabulary import TokenVocabulary

pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    """~3000 tokens of 1-3 characters (quotes, backslashes and a two-byte character among
    them): small, but enough for a bounded repetition of the JSON string body to be slow."""
    alphabet = 'abcdefghij"\\ é'
    pieces = ["".join(p) for n in (1, 2, 3) for p in itertools.product(alphabet, repeat=n)]
    pieces += [chr(c) for c in range(0x20, 0x7F) if chr(c) not in alphabet]
    table = {i + 1: p.encode() for i, p in enumerate(pieces)}
    return TokenVocabulary.from_bytes(table, eos_token_ids=[0], size=len(pieces) + 1)


def test_second_compile_comes_from_disk_then_memory(
    vocab: TokenVocabulary, grammar_home: Path
) -> None:
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    first = compile_grammar(grammar, vocab, engine="outlines", timeout_s=60)
    assert first.source == "compiled" and not first.from_cache
    assert (grammar_cache_dir() / f"{first.key}.index").is_file()
    assert grammar_cache_dir() == grammar_home / "grammar"
    compiler.clear_memory_cache()
    started = time.perf_counter()
    second = compile_grammar(grammar, vocab, engine="outlines", timeout_s=60)
    assert second.source == "disk" and time.perf_counter() - started < 1.0
    assert second.index.get_transitions() == first.index.get_transitions()
    third = compile_grammar(grammar, vocab, engine="outlines", timeout_s=60)
    assert third.source == "memory" and third.compile_s < 0.1


def test_cache_key_depends_on_the_vocabulary(vocab: TokenVocabulary) -> None:
    grammar = regex_grammar("ab+")
    other = TokenVocabulary.from_bytes({1: b"a", 2: b"b"}, eos_token_ids=[0], size=3)
    a = compile_grammar(grammar, vocab, engine="outlines", timeout_s=None)
    b = compile_grammar(grammar, other, timeout_s=None)
    assert a.key != b.key and b.source == "compiled"


def test_no_disk_cache_leaves_nothing(vocab: TokenVocabulary) -> None:
    compile_grammar(
        choice_grammar(["x", "yz"]), vocab, engine="outlines", timeout_s=30, cache=False
    )
    assert not grammar_cache_dir().exists() or not list(grammar_cache_dir().glob("*.index"))


def test_compile_past_the_limit_is_a_grammar_error(vocab: TokenVocabulary) -> None:
    # {0,16} of the JSON string body over this vocabulary takes minutes (see regex_parts).
    slow = regex_grammar(r'"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]){0,16}"')
    started = time.perf_counter()
    with pytest.raises(GrammarError, match=r"longer than the limit of 1 s \(--compile-timeout"):
        compile_grammar(slow, vocab, engine="outlines", timeout_s=1.0)
    assert time.perf_counter() - started < 60  # the worker was killed, not waited for
    # The next compile gets a fresh worker.
    assert (
        compile_grammar(regex_grammar("a+"), vocab, engine="outlines", timeout_s=60).source
        == "compiled"
    )


def test_a_compile_killed_while_writing_leaves_no_temporary_index(
    vocab: TokenVocabulary, monkeypatch: pytest.MonkeyPatch
) -> None:
    def killed_mid_write(
        self: worker_client._Worker, payload: dict[str, str], timeout_s: float
    ) -> None:
        out = Path(payload["out"])  # what the worker writes before its rename, then the kill
        out.with_name(f"{out.name}.tmp-{self.proc.pid}").write_bytes(b"half an index")
        self.close()

    monkeypatch.setattr(worker_client._Worker, "request", killed_mid_write)
    with pytest.raises(GrammarError, match="longer than the limit"):
        compile_grammar(regex_grammar("ab*"), vocab, engine="outlines", timeout_s=5.0, plan=False)
    assert not list(grammar_cache_dir().glob("*.tmp-*"))


def test_trim_sweeps_stale_temporary_files(vocab: TokenVocabulary) -> None:
    folder = grammar_cache_dir()
    folder.mkdir(parents=True)
    stale, fresh = folder / "a.index.tmp-1", folder / "b.index.tmp-2"
    for path in (stale, fresh):
        path.write_bytes(b"x")
    old = time.time() - 2 * compiler._STALE_TMP_S
    os.utime(stale, (old, old))
    compile_grammar(
        regex_grammar("a+b"), vocab, engine="outlines", timeout_s=60, plan=False
    )  # trims the cache
    assert not stale.exists() and fresh.exists()  # a fresh one may be another process's write


def test_regex_errors(vocab: TokenVocabulary) -> None:
    with pytest.raises(GrammarError, match=r"--regex '\(ab': expected a valid regex"):
        regex_grammar("(ab")
    with pytest.raises(GrammarError, match="outlines-core cannot compile it"):
        compile_grammar(
            regex_grammar("(?=a)a"), vocab, engine="outlines", timeout_s=60
        )  # Rust: no lookahead
    with pytest.raises(GrammarError, match="outlines-core cannot compile it"):
        compile_grammar(regex_grammar("(?=a)a"), vocab, engine="outlines", timeout_s=None)


def test_bad_timeout_and_choices(vocab: TokenVocabulary) -> None:
    with pytest.raises(GrammarError, match="--compile-timeout"):
        compile_grammar(regex_grammar("a"), vocab, engine="outlines", timeout_s=0)
    with pytest.raises(GrammarError, match="distinct"):
        choice_grammar(["a", "a"])
    with pytest.raises(GrammarError, match="non-empty"):
        choice_grammar([])


def test_schema_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GrammarError, match="expected a JSON file, got invalid JSON at line 1"):
        load_schema_file(bad)
    with pytest.raises(GrammarError, match="cannot read it"):
        load_schema_file(tmp_path / "missing.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(GrammarError, match="binary"):
        load_schema_file(binary)


def test_missing_outlines_core_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantkit.grammar.vocabulary import import_outlines_core

    monkeypatch.setitem(sys.modules, "outlines_core", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'quantkit\[grammar\]'"):
        import_outlines_core()


def test_llguidance_start_walk_runs_under_the_limit(
    vocab: TokenVocabulary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile's walk from the start state is part of the compile: a walk that would take
    longer than the limit ends in the limit's error, not in a compile that overran it."""
    from quantkit.grammar.llguidance import engine

    walked = engine.LlgRow.closing_path

    def slow_walk(self, **kwargs):
        time.sleep(5.0)
        return walked(self, **kwargs)

    monkeypatch.setattr(engine.LlgRow, "closing_path", slow_walk)
    with pytest.raises(GrammarError, match=r"longer than the limit of 0.5 s"):
        compile_grammar(regex_grammar("ab+"), vocab, engine="llguidance", timeout_s=0.5)
