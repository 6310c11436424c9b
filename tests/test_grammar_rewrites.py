"""Schema rewrites before llguidance (`llguidance.schema`, `llguidance.negation`): each one, on
small real schemas, compiled by llguidance and walked token by token: the valid instances are
accepted, the invalid ones rejected; a narrowed rewrite says so in a note, an exact one never
does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from quantkit.errors import GrammarError
from quantkit.grammar import compiler
from quantkit.grammar.compiler import compile_grammar
from quantkit.grammar.constraints import schema_grammar, validate_json
from quantkit.grammar.llguidance.negation import negation
from quantkit.grammar.llguidance.schema import (
    llguidance_schema,
    simplify_not,
    unique_items_listed,
    without_negation,
)
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import accepts, agrees, vocab_of

PIECES = [*'{}[]":, abcdefghijklmnopqrstuvwxyz0123456789.-_#\n', '{"', '":', '","', '"}',
          "true", "false", "null", "ab"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return vocab_of(PIECES)


walk = accepts  # a value through the compiled grammar, token by token


def llg(schema: Any, vocab: TokenVocabulary) -> compiler.CompiledGrammar:
    """`schema` as llguidance gets it after the rewrites (exact ones: as the engine runs now)."""
    rewritten, _ = llguidance_schema(schema)
    return compile_grammar(schema_grammar(rewritten), vocab, engine="llguidance", timeout_s=10)


def check(schema: Any, vocab: TokenVocabulary, valid: list[Any], invalid: list[Any]) -> None:
    """The instances are what jsonschema says, and the compiled grammar agrees (valid accepted,
    invalid rejected)."""
    agrees(llg(schema, vocab), schema, valid, invalid)


def test_not_of_a_type_an_enum_and_required_is_exact(vocab) -> None:
    schema = {"type": "object", "properties": {
        "a": {"not": {"type": "string"}},
        "b": {"type": "integer", "not": {"enum": [1, 2]}},
        "c": {"type": "string", "not": {"const": "ab"}}},
        "not": {"required": ["d"]}}  # fmt: skip
    assert "not" not in json.dumps(simplify_not(schema))  # exact: done by the engine as it runs
    check(schema, vocab,
          valid=[{"a": 3}, {"a": None, "b": 0}, {"b": 3, "c": "a"}, {"c": "abc"}, {}],
          invalid=[{"a": "x"}, {"b": 1}, {"b": 2}, {"c": "ab"}, {"d": 1}])  # fmt: skip
    assert without_negation(schema)[1] == []  # exact: no note


def test_not_of_a_class_pattern_and_bounds(vocab) -> None:
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "not": {"pattern": "^[ab]+$"}},
        "n": {"type": "integer", "not": {"minimum": 3, "maximum": 5}}}}  # fmt: skip
    check(schema, vocab,
          valid=[{"s": "abc"}, {"s": ""}, {"n": 2}, {"n": 6}],
          invalid=[{"s": "ab"}, {"s": "a"}, {"n": 3}, {"n": 5}])  # fmt: skip


def test_if_then_else_on_a_discriminator_is_exact(vocab) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["k"], "if": {"properties": {"k": {"const": "a"}}},
              "then": {"required": ["n"]}, "else": {"properties": {"n": False}}}  # fmt: skip
    assert without_negation(schema)[1] == []
    check(schema, vocab,
          valid=[{"k": "a", "n": 1}, {"k": "b"}, {"k": "ab"}],
          invalid=[{"k": "a"}, {"k": "b", "n": 1}, {"n": 1}])  # fmt: skip


def test_overlapping_one_of_becomes_an_exact_any_of(vocab) -> None:
    schema = {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}  # fmt: skip
    assert without_negation(schema)[1] == []
    check(schema, vocab, valid=[{"a": 1}, {"b": 2}],
          invalid=[{"a": 1, "b": 2}, {}])  # fmt: skip


def test_one_of_an_enum_and_a_pattern_is_proven_exclusive(vocab) -> None:
    schema = {"type": "string", "oneOf": [{"enum": ["red", "blue"]}, {"pattern": "^#[0-9a-f]{2}$"}]}
    check(schema, vocab, valid=["red", "#0a"], invalid=["green", "#0", 3])


def test_narrowed_rewrites_are_noted_and_sound(vocab) -> None:
    # not of strings with a general pattern: only the other types are left of its complement
    schema = {"type": ["string", "integer"], "not": {"type": "string", "pattern": "a"}}
    rewritten, notes = without_negation(schema)
    assert any("not:" in n for n in notes)
    assert simplify_not(schema) == schema  # the exact pass leaves it
    compiled = compile_grammar(schema_grammar(rewritten), vocab, engine="llguidance", timeout_s=10)
    assert walk(compiled, 3) and not walk(compiled, "a") and not walk(compiled, "bab")
    # if with a multipleOf condition: the else-branch is produced only where its complement is
    schema = {"type": "integer", "if": {"multipleOf": 2}, "then": {"minimum": 10},
              "else": {"maximum": 3}}  # fmt: skip
    rewritten, notes = without_negation(schema)
    assert any("if/then/else" in n for n in notes)
    compiled = compile_grammar(schema_grammar(rewritten), vocab, engine="llguidance", timeout_s=10)
    assert walk(compiled, 12) and not walk(compiled, 4) and not walk(compiled, 5)


def test_dependencies_are_exact_conditionals(vocab) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
              "c": {"type": "integer"}}, "dependentRequired": {"a": ["b"]},
              "dependentSchemas": {"c": {"properties": {"b": {"maximum": 2}}}}}  # fmt: skip
    assert without_negation(schema)[1] == []
    check(schema, vocab,
          valid=[{"a": 1, "b": 5}, {"b": 1}, {"b": 1, "c": 1}, {"c": 1}],
          invalid=[{"a": 1}, {"b": 5, "c": 1}, {"a": 1, "b": 3, "c": 1}])  # fmt: skip


def test_unique_items_over_a_few_constants_is_listed_exactly(vocab) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b", 1]}, "uniqueItems": True}
    rewritten, notes, checked = unique_items_listed(schema)
    assert notes == [] and not checked and len(rewritten["enum"]) == 16  # 1 + 3 + 6 + 6 arrays
    compiled = compile_grammar(schema_grammar(rewritten), vocab, engine="llguidance", timeout_s=10)
    assert walk(compiled, ["a", 1, "b"]) and walk(compiled, [])
    assert not walk(compiled, ["a", "a"]) and not walk(compiled, ["c"])
    booleans = {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}
    assert unique_items_listed(booleans)[0]["enum"] == [[], [True], [False], [True, False],
                                                       [False, True]]  # fmt: skip
    strings = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    assert unique_items_listed(strings) == (
        {"type": "array", "items": {"type": "string"}},
        [],
        True,
    )  # the rows check it (`llguidance.distinct_items`)


def test_a_property_named_like_a_keyword_is_a_name() -> None:
    schema = {"properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}
    assert without_negation(schema) == (schema, [])


VALUES = [None, True, False, 0, 1, 2.5, -3, "", "a", "ab", "b\n", [], [1], [1, "a"], {}, {"a": 1},
          {"a": "x", "b": None}]  # fmt: skip
SCHEMAS = [
    {"type": "integer"}, {"type": ["string", "null"]}, {"enum": ["a", "ab", 1, True]},
    {"const": {"a": 1}}, {"minimum": 1}, {"exclusiveMaximum": 0}, {"minLength": 2},
    {"maxItems": 1}, {"minProperties": 1}, {"required": ["a", "b"]},
    {"properties": {"a": {"type": "integer"}}}, {"anyOf": [{"type": "string"}, {"minimum": 2}]},
    {"allOf": [{"type": "number"}, {"maximum": 1}]}, {"not": {"type": "string"}},
    {"pattern": "^[a]*$"}, {"pattern": "b"}, {"multipleOf": 2}, {"items": {"type": "integer"}},
    {"$ref": "#/$defs/s"}, {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 1,
                            "exclusiveMinimum": True},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_negation_is_sound_and_exact_when_it_says_so(schema: dict[str, Any]) -> None:
    from jsonschema import Draft202012Validator, validators

    root = {"$defs": {"s": {"type": "string", "maxLength": 1}}, **schema}
    found = negation(root, root)
    cls = validators.validator_for(root, default=Draft202012Validator)
    negated = cls({"$defs": root["$defs"], "allOf": [found.schema]})
    for value in VALUES:
        inside = cls(root).is_valid(value)
        assert not (inside and negated.is_valid(value)), value  # never both
        if found.exact:
            assert inside or negated.is_valid(value), value  # exact: one of the two


@pytest.fixture(scope="module")
def ascii_vocab() -> TokenVocabulary:
    """Every printable ASCII character a token (base64 and regex text need more than PIECES)."""
    return vocab_of([bytes([c]) for c in range(32, 127)])


def test_format_byte_is_base64_exactly(ascii_vocab: TokenVocabulary) -> None:
    schema = {"type": "string", "format": "byte"}
    compiled = llg(schema, ascii_vocab)
    assert compiled.notes == ()  # OpenAPI's meaning, written exactly: nothing to warn about
    for text in ("", "TWFu", "TWE=", "TQ==", "aGVsbG8gd29ybGQ="):
        assert walk(compiled, text), text
    for text in ("TWF", "TW=u", "TQ=", "hello world", "TWFu===="):
        assert not walk(compiled, text), text


def test_a_date_never_has_year_0000(ascii_vocab: TokenVocabulary) -> None:
    """llguidance's `date` takes year 0000, which jsonschema's checker rejects (a steered walk
    wrote `0000-01-01`), and February 29 of any year: every real date of 0001-9999 is a
    pattern beside the format, with a note for the year."""
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
              "required": ["d"], "additionalProperties": False}  # fmt: skip
    compiled = llg(schema, ascii_vocab)
    notes = llguidance_schema(schema)[1]
    assert notes == ["#/properties/d: format date: year 0000 is not produced (Python's date "
                     "type and jsonschema's checker reject it)"]  # fmt: skip
    for text in ("2024-02-29", "2000-02-29", "0004-02-29", "0001-01-01", "0999-12-31"):
        assert walk(compiled, {"d": text}), text
        assert validate_json(json.dumps({"d": text}), schema) is None, text
    for text in ("0000-01-01", "2023-02-29", "1900-02-29", "2024-13-01", "2024-04-31"):
        assert not walk(compiled, {"d": text}), text
    mine = {"type": "string", "format": "date", "pattern": "^2"}  # a pattern of its own: kept
    assert llguidance_schema(mine)[0] == mine


def test_the_date_pattern_is_pythons_calendar() -> None:
    """Every year 0000-9999, the days that differ between calendars: the pattern matches
    exactly the dates Python's date type (jsonschema's checker) takes."""
    import datetime
    import re

    from quantkit.grammar.llguidance.schema import _DATE_PATTERN

    pattern = re.compile(_DATE_PATTERN)
    for year in range(10000):
        for month, day in ((2, 29), (2, 28), (2, 30), (4, 31), (12, 31), (1, 1)):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            try:
                datetime.date.fromisoformat(text)
                real = True
            except ValueError:
                real = False
            assert bool(pattern.match(text)) == real, text


def test_format_regex_is_narrowed_to_literal_text_with_a_note(
    ascii_vocab: TokenVocabulary,
) -> None:
    import re

    schema = {"type": "object", "properties": {"match": {"type": "string", "format": "regex"}},
              "required": ["match"], "additionalProperties": False}  # fmt: skip
    compiled = llg(schema, ascii_vocab)
    notes = llguidance_schema(schema)[1]
    assert notes == ["#/properties/match: format regex: only regexes without special characters "
                     "(literal text) are produced"]  # fmt: skip
    for text in ("error", "a-b c/d", ""):
        re.compile(text)  # every produced string is a valid regex
        assert walk(compiled, {"match": text}), text
    for text in ("a.b", "x*", "(ab", "[0-9]+"):
        assert not walk(compiled, {"match": text}), text  # valid regexes too: the narrowing
    # A pattern of its own beside the format: left as it was (llguidance refuses the format).
    kept = {"type": "string", "format": "regex", "pattern": "^a"}
    assert llguidance_schema(kept)[0] == kept


def test_a_format_no_draft_defines_is_an_annotation_a_defined_one_a_refusal(
    ascii_vocab: TokenVocabulary,
) -> None:
    props = {"topic": {"type": "string", "format": "topic"},
             "id": {"type": "integer", "format": "int64"}}  # fmt: skip
    schema = {"type": "object", "properties": props, "required": ["topic", "id"]}
    rewritten, notes = llguidance_schema(schema)
    assert "format" not in rewritten["properties"]["topic"]
    assert notes == [
        "#/properties/topic: format 'topic' is not enforced (an annotation, as in 2020-12)",
        "#/properties/id: format 'int64' is not enforced (an annotation, as in 2020-12)",
    ]
    compiled = compile_grammar(schema_grammar(schema), ascii_vocab, engine="llguidance",
                               timeout_s=10)  # fmt: skip
    assert any("format 'topic' is not enforced" in n for n in compiled.notes)
    assert walk(compiled, {"topic": "news/a", "id": 7}) and not walk(compiled, {"topic": 1})
    # A format a draft defines, which validators check: llguidance's refusal stands.
    template = {"type": "string", "format": "uri-template"}
    assert llguidance_schema(template)[0] == template
    with pytest.raises(GrammarError, match="uri-template"):
        compile_grammar(schema_grammar(template), ascii_vocab, engine="llguidance", timeout_s=10)
