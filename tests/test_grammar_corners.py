"""The key-corner look-ahead's shortcuts (`llguidance.key_corners`): a verdict's held matcher
and the schema's names tell the same answers as the full search over copies and masks, and
leave the row's matcher as they found it."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from quantkit.grammar.llguidance.key_corners import KeyCorners
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import EOS, fed_row, vocab_of
from tests.hand_vocab import llguidance as llg

PIECES = [*'{}[]":,abcdefghijklmnopqrstuvwxyz0123456789', '","', '":', ',"', '"ab"', "ab",
          "abc", '"ab":']  # fmt: skip

pytestmark = pytest.mark.usefixtures("grammar_home")

INT = {"type": "integer"}
CASES: list[tuple[dict[str, Any], list[str]]] = [
    # declared names, one the beginning of another: the names tell which bytes to try
    ({"type": "object", "properties": {"ab": INT, "abc": INT, "cd": INT, "e": INT},
      "additionalProperties": False},
     ['{"ab":1,', '{"ab":1,"', '{"ab":1,"a', '{"ab":1,"abc":2,"', '{"ab":1,"abc":2,"cd":3,"']),
    # names only as a pattern: no names to try, then a letter
    ({"type": "object", "patternProperties": {"^(ab|cd)$": INT}, "additionalProperties": False},
     ['{"ab":1,', '{"ab":1,"', '{"ab":1,"cd":2', '{"ab":1,"c']),
    # free names: any letter leaves the written ones
    ({"type": "object", "additionalProperties": INT}, ['{"ab":1,', '{"ab":1,"a', '{"ab":1,"ab']),
]  # fmt: skip


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return vocab_of(PIECES)


def _mask(matcher: Any, vocab: TokenVocabulary) -> bytes:
    line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(line.ctypes.data, line.nbytes)
    return line.tobytes() + bytes(matcher.compute_ff_bytes())


def test_the_shortcuts_tell_what_the_full_search_tells(vocab) -> None:
    """At states in and before keys of objects with written names, for every token the
    grammar allows: the row's look-ahead (its schema's names, the matcher holding the token,
    a memo) answers as a search that only copies and masks, and the matcher's mask and forced
    bytes are the same after it; both answers occur, and the shortcuts told some of them."""
    full = copy.copy(KeyCorners.of(vocab))
    full._leaves_named = lambda *_: False  # type: ignore[method-assign]  # masks only
    quick = KeyCorners._quick
    told = {"quick": 0, "cornered": 0, "clear": 0}

    def counted(self: KeyCorners, *args: Any) -> bool | None:
        found = quick(self, *args)
        told["quick"] += found is not None
        return found

    KeyCorners._quick = counted  # type: ignore[method-assign]
    try:
        for schema, texts in CASES:
            for text in texts:
                row = fed_row(vocab, schema, text)
                corners, state, llg_row = row.corners, row.state, row.row
                matcher = llg_row.matcher
                assert corners is not None and corners is not full
                before = _mask(matcher, vocab)
                allowed = [t for t in range(1, vocab.size)
                           if t not in EOS and matcher.validate_tokens([t]) == 1]  # fmt: skip
                memo: dict[int, bool] = {}
                for token in allowed:
                    after = llg_row.copy_after
                    want = full._cornered(state, lambda t=token, a=after: a(t), token)
                    assert matcher.consume_token(token)
                    llg_row.tried = token  # held, as a verdict that allowed it holds it
                    held = _mask(matcher, vocab)
                    got = corners._cornered(state, lambda t=token, a=after: a(t), token,
                                            llg_row.holding(token), memo)  # fmt: skip
                    assert _mask(matcher, vocab) == held, (text, vocab.token_bytes[token])
                    llg_row.untry()
                    assert got == want, (text, vocab.token_bytes[token])
                    assert memo[token] == want
                    told["cornered" if want else "clear"] += 1
                assert _mask(matcher, vocab) == before, text
    finally:
        KeyCorners._quick = quick  # type: ignore[method-assign]
    assert told["cornered"] > 0 and told["clear"] > 0 and told["quick"] > 0, told


def test_a_row_looks_ahead_with_its_schema_names(vocab) -> None:
    """The compile hands the row a look-ahead that knows the schema's property names (as JSON
    writes them between the quotes); the vocabulary's own knows none."""
    schema = {"type": "object", "properties": {"ab": INT, 'q"x': INT, "é": INT}}
    row = llg(schema, vocab).new_row()
    assert row.corners.names == {b"ab", b'q\\"x', "é".encode()}
    assert KeyCorners.of(vocab).names == frozenset()
