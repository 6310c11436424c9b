"""Objects in any key order for llguidance (`schema_order.any_order`): the rewrite is exact
(every order of a small object's keys accepted, nothing invalid gained), bounded (larger
objects, or ones a `$ref` points into, stay in declaration order and are noted), and a schema
the copies make too large for llguidance is compiled as written instead."""

from __future__ import annotations

import json
from itertools import permutations
from typing import Any

import pytest

from quantkit.grammar import schema_order
from quantkit.grammar.constraints import validate_json
from quantkit.grammar.schema_order import any_order
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import accepts, vocab_of
from tests.hand_vocab import llguidance as llg

PIECES = [*'{}[]":, abcdefghijklmnopqrstuvwxyz0123456789.-_#', '{"', '":', '","', "true",
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
    from quantkit.grammar.llg_engine import _greedy_encoder

    compiled = llg(CALL, vocab)
    text = b'{"size":1,"shape":"circle","size":2}'
    assert not accepts_tokens(compiled, _greedy_encoder(vocab)(text))


def test_nested_objects_are_unordered_too(vocab) -> None:
    schema = {"type": "object", "properties": {"a": CALL, "b": {"type": "integer"}},
              "required": ["a", "b"]}  # fmt: skip
    compiled = llg(schema, vocab)
    assert accepts(compiled, {"b": 1, "a": {"size": 2, "shape": "square"}})
    assert not accepts(compiled, {"b": 1, "a": {"size": 2}})


def test_large_objects_stay_ordered_and_are_noted(vocab) -> None:
    names = "abcdefg"[: schema_order.MAX_PROPERTIES + 1]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
    rewritten, ordered = any_order(schema)
    assert rewritten == schema and ordered == ["#"]
    compiled = llg(schema, vocab)
    assert any("#: declared properties are produced in declaration order" in n
               for n in compiled.notes)  # fmt: skip
    assert accepts(compiled, {"a": 1, "b": 2}) and not accepts(compiled, {"b": 2, "a": 1})


def test_a_ref_into_the_properties_keeps_them_in_place() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
              "c": {"$ref": "#/properties/a"}}}  # fmt: skip
    assert any_order(schema) == (schema, ["#"])
    remote = {"type": "object", "properties": {"a": {"$ref": "other.json#/x"},
              "b": {"type": "string"}}}  # fmt: skip
    assert any_order(remote) == (remote, ["#"])


def test_definitions_and_annotations_stay_on_the_node() -> None:
    schema = {"title": "T", "$defs": {"n": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"type": "string"}},
              "required": ["a"]}  # fmt: skip
    rewritten, ordered = any_order(schema)
    assert ordered == [] and rewritten["$defs"] == schema["$defs"] and rewritten["title"] == "T"
    orders = [list(copy["properties"]) for copy in rewritten["anyOf"]]
    assert orders == [["a", "b"], ["b", "a"]]
    assert all(copy["required"] == ["a"] and "$defs" not in copy for copy in rewritten["anyOf"])


def test_too_large_for_llguidance_compiles_as_written(
    vocab, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantkit.grammar import llg_engine

    def too_many_copies(schema: Any) -> tuple[Any, list[str]]:
        """As if the copies had grown past llguidance's size limit ("schema too large")."""
        copies = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
                  for i in range(20000)]  # fmt: skip
        return {"anyOf": copies}, []

    monkeypatch.setattr(llg_engine, "any_order", too_many_copies)
    compiled = llg(CALL, vocab)
    assert accepts(compiled, {"shape": "circle", "size": 3})
    assert not accepts(compiled, {"size": 3, "shape": "circle"})
    assert any("#: declared properties are produced in declaration order" in n
               for n in compiled.notes)  # fmt: skip
