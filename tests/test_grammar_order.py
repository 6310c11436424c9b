"""Objects in any key order for llguidance (`llguidance.order.any_order`): the rewrite is exact
(every order of a small object's keys accepted, nothing invalid gained); a larger object's
optional keys come in any order (as exact-name patterns) and its required ones first or all in
declaration order (noted); bounded (objects a `$ref` points into, or whose own patterns may
match a name, stay in declaration order and are noted), and a schema the copies make too large
for llguidance is compiled as written instead."""

from __future__ import annotations

import json
from itertools import permutations
from typing import Any

import pytest

from quantkit.grammar.constraints import validate_json
from quantkit.grammar.llguidance import order as schema_order
from quantkit.grammar.llguidance.order import any_order
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import accepts, vocab_of
from tests.hand_vocab import llguidance as llg

PIECES = [*'{}[]":, abcdefghijklmnopqrstuvwxyz0123456789.-_#+()$^', '{"', '":', '","', "true",
          "false", "null"]  # fmt: skip

# Three keys, two required, closed: a small real shape (an API call's arguments).
CALL = {
    "type": "object",
    "properties": {"shape": {"enum": ["circle", "square"]}, "size": {"type": "integer"},
                   "fill": {"type": "boolean"}},
    "required": ["shape", "size"],
    "additionalProperties": False,
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return vocab_of(PIECES)


def _reordered(value: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    return {k: value[k] for k in order if k in value}


def test_every_key_order_is_accepted_and_nothing_invalid(vocab) -> None:
    compiled = llg(CALL, vocab)
    full = {"shape": "circle", "size": 3, "fill": True}
    for order in permutations(full):
        for value in (_reordered(full, order), _reordered({"shape": "square", "size": 1}, order)):
            assert validate_json(json.dumps(value), CALL) is None
            assert accepts(compiled, value), value
    invalid = [{"size": 3}, {"size": 3, "shape": "oval"}, {"fill": True, "size": 1},
               {"size": 1, "shape": "circle", "other": 1}]  # fmt: skip
    for value in invalid:
        assert validate_json(json.dumps(value), CALL) is not None
        assert not accepts(compiled, value), value
    assert not any("declaration order" in n for n in compiled.notes)


def test_a_duplicate_key_is_rejected(vocab) -> None:
    from quantkit.grammar.acceptance import accepts_tokens
    from quantkit.grammar.llguidance.engine import _greedy_encoder

    compiled = llg(CALL, vocab)
    text = b'{"size":1,"shape":"circle","size":2}'
    assert not accepts_tokens(compiled, _greedy_encoder(vocab)(text))


def test_nested_objects_are_unordered_too(vocab) -> None:
    schema = {"type": "object", "properties": {"a": CALL, "b": {"type": "integer"}},
              "required": ["a", "b"]}  # fmt: skip
    compiled = llg(schema, vocab)
    assert accepts(compiled, {"b": 1, "a": {"size": 2, "shape": "square"}})
    assert not accepts(compiled, {"b": 1, "a": {"size": 2}})


def _notes(compiled: Any, what: str) -> list[str]:
    return [n for n in compiled.notes if what in n]


def test_a_large_object_of_optional_keys_takes_any_order(vocab) -> None:
    names = "abcdefg"[: schema_order.MAX_PROPERTIES + 1]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
              "additionalProperties": False}  # fmt: skip
    rewritten, orders = any_order(schema)
    assert "properties" not in rewritten and len(rewritten["patternProperties"]) == len(names)
    assert orders.notes() == []
    compiled = llg(schema, vocab)
    full = {n: i for i, n in enumerate(names)}
    for order in [tuple(reversed(names)), (names[2], names[0]), (names[-1],)]:
        assert accepts(compiled, _reordered(full, order)), order
    assert accepts(compiled, {})
    for value in ({"z": 1}, {names[0]: "x"}, {names[1]: 1, "aa": 2}):
        assert validate_json(json.dumps(value), schema) is not None
        assert not accepts(compiled, value), value
    assert not _notes(compiled, "declaration order")


def test_required_keys_come_first_or_all_in_declaration_order(vocab) -> None:
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in "abcde"},
              "required": ["d", "b"], "additionalProperties": False}  # fmt: skip
    compiled = llg(schema, vocab)
    for value in (
        {"d": 1, "b": 2, "e": 3, "a": 4},
        {"b": 1, "d": 2},
        {"b": 1, "d": 2, "c": 3},
        {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5},
        {"b": 1, "c": 2, "d": 3},
    ):
        assert validate_json(json.dumps(value), schema) is None
        assert accepts(compiled, value), value
    for value in ({"a": 1, "b": 2}, {"d": 1}, {"d": 1, "b": 2, "f": 3}, {"d": 1, "b": "x"}):
        assert validate_json(json.dumps(value), schema) is not None
        assert not accepts(compiled, value), value
    # Valid, but neither form: an optional key before a required one, out of declaration order.
    assert not accepts(compiled, {"e": 1, "b": 2, "d": 3})
    assert _notes(
        compiled,
        "#: declared properties are produced in declaration order, or the "
        "required ones first and then the optional ones, each in any order",
    )


def test_many_required_keys_keep_their_declaration_order(vocab) -> None:
    names = "abcdef"[: schema_order.MAX_PROPERTIES + 2]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
              "required": list(names[:-1])}  # fmt: skip
    compiled = llg(schema, vocab)
    required = {n: 1 for n in names[:-1]}
    assert accepts(compiled, required) and accepts(compiled, required | {names[-1]: 2})
    assert not accepts(compiled, {names[-1]: 2} | required)  # valid, neither form (noted)
    assert not accepts(compiled, _reordered(required, tuple(reversed(names[:-1]))))
    assert _notes(compiled, "or the required ones first in declaration order")


def test_names_are_matched_exactly_whatever_they_hold(vocab) -> None:
    names = ["a.b", "c+d", "(e)", "f$", "^g", "h i"]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
              "additionalProperties": False}  # fmt: skip
    compiled = llg(schema, vocab)
    assert accepts(compiled, {"h i": 1, "^g": 2, "f$": 3, "(e)": 4, "c+d": 5, "a.b": 6})
    for value in ({"axb": 1}, {"ccd": 1}, {"e": 1}, {"f": 1}, {"g": 1}, {"hxi": 1}):
        assert not accepts(compiled, value), value


def test_a_pattern_that_may_match_a_name_leaves_the_object_ordered(vocab) -> None:
    names = "abcdefg"[: schema_order.MAX_PROPERTIES + 1]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
              "patternProperties": {"^[ab]": {"minimum": 0}}}  # fmt: skip
    rewritten, orders = any_order(schema)
    assert rewritten == schema and orders.ordered == ["#"]
    compiled = llg(schema, vocab)
    assert _notes(compiled, "#: declared properties are produced in declaration order only")
    assert accepts(compiled, {"a": 1, "b": 2}) and not accepts(compiled, {"b": 2, "a": 1})
    assert not accepts(compiled, {"a": -1})


def test_a_ref_into_the_properties_keeps_them_in_place() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
              "c": {"$ref": "#/properties/a"}}}  # fmt: skip
    assert any_order(schema) == (schema, schema_order.Orders(["#"]))
    remote = {"type": "object", "properties": {"a": {"$ref": "other.json#/x"},
              "b": {"type": "string"}}}  # fmt: skip
    assert any_order(remote) == (remote, schema_order.Orders(["#"]))


def test_definitions_and_annotations_stay_on_the_node() -> None:
    schema = {"title": "T", "$defs": {"n": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"type": "string"}},
              "required": ["a"]}  # fmt: skip
    rewritten, orders = any_order(schema)
    assert orders.notes() == [] and rewritten["$defs"] == schema["$defs"]
    assert rewritten["title"] == "T"
    assert [list(copy["properties"]) for copy in rewritten["anyOf"]] == [["a", "b"], ["b", "a"]]
    assert all(copy["required"] == ["a"] and "$defs" not in copy for copy in rewritten["anyOf"])


def test_too_large_for_llguidance_compiles_as_written(
    vocab, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantkit.grammar.llguidance import engine as llg_engine

    def too_many_copies(schema: Any, **_: Any) -> tuple[Any, schema_order.Orders]:
        """As if the copies had grown past llguidance's size limit ("schema too large")."""
        copies = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
                  for i in range(20000)]  # fmt: skip
        return {"anyOf": copies}, schema_order.Orders()

    monkeypatch.setattr(llg_engine, "any_order", too_many_copies)
    compiled = llg(CALL, vocab)
    assert accepts(compiled, {"shape": "circle", "size": 3})
    assert not accepts(compiled, {"size": 3, "shape": "circle"})
    assert any("#: declared properties are produced in declaration order" in n
               for n in compiled.notes)  # fmt: skip


def _walk(compiled: Any, text: bytes) -> Any:
    from quantkit.grammar.llguidance.engine import _greedy_encoder

    row = compiled.new_row()
    assert all(row.advance(t) for t in _greedy_encoder(compiled.vocabulary)(text)), text
    return row


def _allowed(row: Any, vocab: TokenVocabulary) -> set[bytes]:
    import numpy as np

    line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    row.fill(line)
    bits = line.view(np.uint32)
    return {d for t, d in vocab.token_bytes.items() if bits[t >> 5] >> (t & 31) & 1}


@pytest.mark.parametrize("closed", [True, False])
def test_a_key_made_a_pattern_is_not_repeated(closed: bool) -> None:
    """llguidance lets a pattern property's key repeat; the rows refuse the token that would
    end a key its object has already, inside the key or written whole by one token."""
    vocab = vocab_of([*'{}":,abcdef0123456789', '":', 'a"', '"a"', ',"a"'])
    names = "abcdef"[: schema_order.MAX_PROPERTIES + 1]
    schema: dict[str, Any] = {"type": "object", "properties": {n: {"type": "integer"} for n in
                              names}, "additionalProperties": not closed}  # fmt: skip
    compiled = llg(schema, vocab)
    assert accepts(compiled, {"b": 1, "a": 2, "c": 3})
    for text in (b'{"a":1,"a":2}', b'{"b":1,"a":2,"b":3}'):
        assert not accepts_text_tokens(compiled, text), text
    row = _walk(compiled, b'{"a":1,"b":2,"a')
    inside = _allowed(row, vocab)
    if not closed:  # "aa" and longer keys may follow: the repeat is masked
        assert {b'"', b'":'}.isdisjoint(inside) and b'a"' in inside
    else:  # only the repeat can follow: let through rather than a dead end (the last counts)
        assert b'":' in inside and b'a"' not in inside
        by_bytes = {d: t for t, d in vocab.token_bytes.items()}
        assert all(row.advance(by_bytes[p]) for p in (b'":', b"3", b"}")) and row.is_finished()
    outside = _allowed(_walk(compiled, b'{"a":1'), vocab)
    assert b',"a"' not in outside and b"," in outside
    assert b',"a"' in _allowed(_walk(compiled, b'{"b":1'), vocab)


def accepts_text_tokens(compiled: Any, text: bytes) -> bool:
    from quantkit.grammar.acceptance import accepts_tokens
    from quantkit.grammar.llguidance.engine import _greedy_encoder

    return accepts_tokens(compiled, _greedy_encoder(compiled.vocabulary)(text))


def test_keys_repeat_only_within_one_object() -> None:
    from quantkit.grammar.llguidance.distinct_items import DistinctItems

    ok = b'{"a":{"a":1,"b":"a"},"b":[{"a":1},{"a":1}],"c":{"\\"a":1,"a":2}}'
    assert DistinctItems(items=False, keys=True).feed(ok)
    assert not DistinctItems(items=False, keys=True).feed(b'{"a":1,"b":{"a":2},"a"')
    assert not DistinctItems(items=False, keys=True).feed(b'[{"x":[1,{"y":1,"y"')
    assert DistinctItems(items=False, keys=False).feed(b'{"a":1,"a"')  # tracked, not refused


def test_a_token_closing_a_value_and_writing_a_repeated_key_is_masked() -> None:
    vocab = vocab_of([*'{}":,abcdefxy', '","a"', '","b"'])
    names = "abcdef"[: schema_order.MAX_PROPERTIES + 1]
    schema = {"type": "object", "properties": {n: {"type": "string"} for n in names}}
    compiled = llg(schema, vocab)
    allowed = _allowed(_walk(compiled, b'{"a":"x","b":"y'), vocab)
    assert b'","a"' not in allowed and b'","b"' not in allowed and b'"' in allowed
    assert b'","a"' in _allowed(_walk(compiled, b'{"b":"x","c":"y'), vocab)


def test_names_overlapping_a_pattern_merged_from_allof_keep_their_order(vocab) -> None:
    """llguidance refuses overlapping patterns; a larger object whose names would overlap a
    pattern that an allOf brings in is compiled with its declared order instead."""
    names = "abcdefg"[: schema_order.MAX_PROPERTIES + 1]
    schema = {"type": "object", "patternProperties": {"^[a-z]$": {"type": "integer"}},
              "allOf": [{"properties": {n: {"minimum": 0} for n in names}}]}  # fmt: skip
    compiled = llg(schema, vocab)
    assert accepts(compiled, {"a": 1, "b": 2}) and not accepts(compiled, {"a": -1})
    assert _notes(compiled, "declaration order only")
