"""`uniqueItems` beside llguidance (`llguidance.distinct_items`): the rows refuse the token that
would complete a repeated array item, equal as JSON Schema compares values (1 and 1.0, objects in
any key order), clear it from the mask so sampling never picks it, and say when the check reaches
arrays the schema lets repeat items."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from quantkit.grammar.llguidance.distinct_items import DistinctItems, all_arrays_unique, canonical
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import accepts, agrees, vocab_of
from tests.hand_vocab import llguidance as llg

PIECES = [*'{}[]":,abcdefghijklmnopqrstuvwxyz0123456789.-\\', '",', '"]', '["', 'ab"', "ab",
          "1,", "1]", "1.0"]  # fmt: skip
TAGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return vocab_of(PIECES)


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        (TAGS, [[], ["a"], ["a", "b", "ab"], ['a"', "a"]], [["a", "a"], ["ab", "a", "ab"],
                                                           ['a"', 'a"']]),
        ({"type": "array", "items": {"type": "number"}, "uniqueItems": True},
         [[1, 2, 12], [1, 1.5]], [[1, 1.0], [2, 1, 2]]),
        ({"type": "array", "items": {"type": "object"}, "uniqueItems": True},
         [[{"a": 1}, {"a": 2}], [{"a": 1}, {"b": 1}]], [[{"a": 1, "b": 2}, {"b": 2, "a": 1}]]),
        ({"type": "array", "items": {"type": "array", "uniqueItems": True}, "uniqueItems": True},
         [[[1], [2], [1, 2]], [[]]], [[[1], [1]], [[1, 1]]]),
    ],
)  # fmt: skip
def test_repeated_items_are_refused_as_json_schema_compares_them(
    vocab, schema: Any, valid: list[Any], invalid: list[Any]
) -> None:
    compiled = llg(schema, vocab)
    # Noted only where the schema allows some array that may repeat items (free object values).
    assert (compiled.notes == ()) == all_arrays_unique(schema) == ("object" not in str(schema))
    agrees(compiled, schema, valid, invalid)


def test_the_token_completing_a_repeat_is_cleared_from_the_mask(vocab) -> None:
    compiled = llg(TAGS, vocab)
    row = compiled.new_row()
    by_piece = {p: i + 1 for i, p in enumerate(PIECES)}
    for piece in ('["', "ab", '",', '"', "ab"):  # ["ab","ab
        assert row.advance(by_piece[piece])
    line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    row.fill(line)
    allowed = {t for t in range(vocab.size) if (int(line[t >> 5]) >> (t & 31)) & 1}
    for piece in ('"', '",', '"]'):  # each would complete "ab" a second time
        assert by_piece[piece] not in allowed, piece
    assert by_piece["c"] in allowed and by_piece["ab"] in allowed  # "abc", "abab": new items


def test_greedy_decoding_that_prefers_a_repeat_still_ends_valid(vocab) -> None:
    """A 'model' that writes "ab" as every item: the mask steers it to distinct ones."""
    compiled = llg({**TAGS, "minItems": 3, "maxItems": 3}, vocab)
    by_piece = {p: i + 1 for i, p in enumerate(PIECES)}
    row, text = compiled.new_row(), b'["'
    assert row.advance(by_piece['["'])
    line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    for _ in range(40):
        if row.is_finished():
            break
        wish = ['",', '"]'] if text.endswith(b"ab") else ["ab"]
        row.fill(line)
        allowed = [p for p in [*wish, '"', "c", "]"]
                   if (int(line[by_piece[p] >> 5]) >> (by_piece[p] & 31)) & 1]  # fmt: skip
        assert allowed, text
        assert row.advance(by_piece[allowed[0]])
        text += allowed[0].encode()
    value = json.loads(text)
    assert row.is_finished() and len(value) == 3 and len(set(value)) == 3, text
    assert value[0] == "ab"  # the first one it wished for was free


def test_the_check_on_the_text_itself() -> None:
    state = DistinctItems()
    assert state.feed(b'{"t":[1,"x",[1,2],{"a":[1,1]}') is False  # the inner [1,1] repeats 1
    state = DistinctItems()
    assert state.feed(b'[1,"1",true,null,1.5,') and state.first_repeat([b"2,", b"1.50]"]) == 1
    assert state.first_repeat([b"2,", b"3]"]) is None
    assert state.feed(b"2]")  # the probes' look-ahead left this state as it was
    assert canonical(b'{"b":1.0,"a":[2.0]}') == canonical(b'{"a":[2],"b":1}')


def test_where_a_token_leaves_a_key_is_told_as_a_probe_tells_it() -> None:
    """`key_after`'s shortcuts (no probe where `data` has no quote: inside a value's string,
    inside a key, or where no key is wanted and no `,` or closing bracket could want one)
    agree with feeding `data` to a probe, at every byte of a document with keys, nested objects
    and arrays, escapes and a written key begun again, for pieces of every kind."""
    doc = b'{"ab":1,"c\\"d":{"x":[1,{"y":2}],"z":"v,\\"}"},"e":[{"a":1},{"a":2}], "ab'
    pieces = [b"", b"a", b"ab", b"1", b"1,", b",", b", ", b'"', b'",', b'","', b'"a', b"}",
              b"},", b"]", b"],", b"{", b'{"', b"[", b"[{", b":", b'":', b"\\", b" "]  # fmt: skip
    told = 0
    for end in range(len(doc) + 1):
        state = DistinctItems(keys=True)
        assert state.feed(doc[:end]), doc[:end]
        for data in pieces:
            try:
                fed = state._key_after_fed(data)
            except ValueError:  # would end an item that is not JSON: no grammar allows it
                continue
            assert state.key_after(data) == fed, (doc[:end], data)
            told += fed is not None
    assert told > 50  # keys were in question, not only values


def test_narrowing_is_noted_where_other_arrays_could_repeat_items(vocab) -> None:
    mixed = {"type": "object", "properties": {"tags": TAGS, "scores": {"type": "array"}},
             "additionalProperties": False}  # fmt: skip
    assert not all_arrays_unique(mixed) and all_arrays_unique(TAGS)
    open_object = {"type": "object", "properties": {"tags": TAGS}}  # other values are free
    assert not all_arrays_unique(open_object)
    compiled = llg(mixed, vocab)
    assert any("uniqueItems is checked on every array" in n for n in compiled.notes)
    assert accepts(compiled, {"tags": ["a", "b"], "scores": [1]})
    assert not accepts(compiled, {"tags": ["a", "a"]})


def test_tokens_that_open_and_end_a_repeat_in_one_piece_are_masked_too() -> None:
    """Outside a string, `"ab"` both opens and ends an item; in an array with no item yet,
    `"a","a"` ends two equal ones: neither may stay allowed (sampling would pick a token that
    `advance` then refuses)."""
    pieces = [*'[]",abc', '"ab"', '"a","a"', '"a","b"']
    vocab = vocab_of(pieces)
    compiled = llg(TAGS, vocab)
    by_piece = {p: i + 1 for i, p in enumerate(pieces)}

    def allowed_after(prefix: list[str]) -> set[str]:
        row = compiled.new_row()
        for piece in prefix:
            assert row.advance(by_piece[piece]), piece
        line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
        row.fill(line)
        return {p for p, t in by_piece.items() if (int(line[t >> 5]) >> (t & 31)) & 1}

    assert {'"a","b"', '"ab"'} <= allowed_after(["["]) and '"a","a"' not in allowed_after(["["])
    after_ab = allowed_after(["[", '"ab"', ","])
    assert '"ab"' not in after_ab and '"a","b"' in after_ab


def test_a_dead_end_made_by_the_check_says_so(vocab) -> None:
    """maxLength 2 and a second "ab": only the closing quote is left, and it would repeat."""
    import torch

    from quantkit.errors import GrammarError
    from quantkit.grammar.processor import GrammarLogitsProcessor

    tags = {**TAGS, "items": {"type": "string", "maxLength": 2}, "minItems": 2}
    processor = GrammarLogitsProcessor([llg(tags, vocab)])
    by_piece = {p: i + 1 for i, p in enumerate(PIECES)}
    ids = [by_piece[p] for p in ('["', "ab", '",', '"', "ab")]
    logits = torch.zeros(1, vocab.size)
    processor(torch.tensor([[0]]), logits)  # the first step: no token fed yet
    with pytest.raises(GrammarError, match=r"dead end\): every token .* repeat .* uniqueItems"):
        for n in range(1, len(ids) + 1):
            processor(torch.tensor([[0, *ids[:n]]]), logits)
