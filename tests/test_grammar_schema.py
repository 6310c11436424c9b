"""JSON Schema -> regex: leaf regexes, lowering, unsupported keywords, soundness.

Regexes are checked with Python's `re` (quantkit emits only syntax Rust's regex and `re` read
alike); no model, no outlines-core index needed except where marked.
"""

from __future__ import annotations

import datetime
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from quantkit.errors import EvalError, GrammarError
from quantkit.evals.grammar.data import DATA_ENV
from quantkit.evals.grammar.testsuite import SUITE_ENV, default_suite_dir, main, run_suite
from quantkit.grammar.acceptance import accepts_text
from quantkit.grammar.constraints import choice_grammar, json_schema_grammar, validate_json
from quantkit.grammar.outlines.schema_regex.json_schema import schema_to_regex
from quantkit.grammar.outlines.schema_regex.regex_parts import (
    FORMATS,
    integer_regex,
    json_literal_regex,
    number_regex,
    string_length_regex,
)
from quantkit.grammar.outlines.schema_regex.regex_pattern import pattern_string_regex


def full(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


# --------------------------------------------------------------------------- leaves


@pytest.mark.parametrize(
    "lo,hi,lo_x,hi_x",
    [(-15, 123, False, False), (7, None, True, False), (None, -3, False, True),
     (0, 0, False, False), (-1000, 999, False, False), (0.5, 9.5, False, False),
     (None, None, False, False)],
)  # fmt: skip
def test_integer_regex_is_exactly_the_range(lo, hi, lo_x, hi_x) -> None:
    regex = integer_regex(lo, hi, exclusive_minimum=lo_x, exclusive_maximum=hi_x)
    for n in range(-1200, 1200):
        inside = (lo is None or (n > lo if lo_x else n >= lo)) and (
            hi is None or (n < hi if hi_x else n <= hi)
        )
        assert full(regex, str(n)) == inside, (n, regex)
    assert not full(regex, "007") and not full(regex, "-0") and not full(regex, "1.0")


def test_integer_regex_empty_range_is_an_error() -> None:
    with pytest.raises(GrammarError, match="non-empty range"):
        integer_regex(5, 5, exclusive_minimum=True)


@pytest.mark.parametrize(
    "lo,hi,lo_x,hi_x",
    [(0, 1, True, True), (-2.5, 3, False, False), (0, None, False, False), (None, 100, False, True),
     (-10, -2, True, False), (1, 1, False, False)],
)  # fmt: skip
def test_number_regex_is_sound_and_keeps_integers(lo, hi, lo_x, hi_x) -> None:
    regex = number_regex(lo, hi, exclusive_minimum=lo_x, exclusive_maximum=hi_x)

    def inside(v: Fraction) -> bool:
        return (lo is None or (v > lo if lo_x else v >= Fraction(lo))) and (
            hi is None or (v < hi if hi_x else v <= Fraction(hi))
        )

    texts = [f"{i}" for i in range(-30, 130)] + [f"{q / 4:.2f}" for q in range(-120, 500)]
    texts += ["-0.5", "0.001", "-0", "1e3", "0.10"]
    for text in texts:
        if full(regex, text):  # sound: every accepted text is in range
            assert inside(Fraction(text)), (text, regex)
    for i in range(-30, 130):  # integers in range (narrowed to integer bounds) are accepted
        if inside(Fraction(i)) and (lo is None or i >= lo) and (hi is None or i <= hi):
            assert full(regex, str(i)) or (lo_x and i == lo) or (hi_x and i == hi), (i, regex)


def test_literals_put_longer_alternatives_first() -> None:
    # outlines-core's automaton is leftmost-first: "1" before "12" would cut "12" off.
    assert json_literal_regex([1, 12, "a", None]) == '(?:null|"a"|12|1)'
    assert choice_grammar(["a", "ab", "abc"]).regex == "(?:abc|ab|a)"


def test_date_format_accepts_only_calendar_dates() -> None:
    regex = f'"{FORMATS["date"][0]}"'
    day = datetime.date(2023, 1, 1)
    while day.year < 2025:
        assert full(regex, f'"{day.isoformat()}"'), day
        day += datetime.timedelta(days=1)
    for bad in ["2023-02-29", "2023-04-31", "2024-13-01", "0000-01-01", "2024-1-01"]:
        assert not full(regex, f'"{bad}"'), bad
    assert full(regex, '"2000-02-29"') and not full(regex, '"1900-02-29"')


def _random_texts(regex: str, count: int, seed: int) -> list[str]:
    """Random texts of `regex`'s language: random walks through an outlines-core index over
    single bytes (each ends at a closing quote, so no accepting state is cut short)."""
    import random

    import outlines_core

    from quantkit.grammar.compiler import compile_grammar
    from quantkit.grammar.constraints import Grammar
    from quantkit.grammar.vocabulary import TokenVocabulary

    vocab = TokenVocabulary.from_bytes(
        {b: bytes([b]) for b in range(128)}, eos_token_ids=[200], size=201
    )
    compiled = compile_grammar(
        Grammar("regex", regex, "format"), vocab, timeout_s=None, cache=False
    )
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        guide, data = outlines_core.Guide(compiled.index), bytearray()
        while not guide.is_finished() and len(data) < 400:
            token = rng.choice([t for t in guide.get_tokens() if t != 200])
            guide.advance(token, return_tokens=False)
            data.append(token)
        if guide.is_finished():
            out.append(data.decode())
    return out


@pytest.mark.parametrize("fmt", ["date", "date-time", "time", "email", "ipv4", "ipv6", "uuid"])
def test_format_regexes_produce_values_the_format_checker_accepts(fmt: str) -> None:
    from jsonschema import Draft202012Validator

    checker = Draft202012Validator.FORMAT_CHECKER
    texts = _random_texts(f'"{FORMATS[fmt][0]}"', 40, seed=len(fmt))
    assert len(texts) >= 20
    for text in texts:
        value = json.loads(text)
        assert checker.conforms(value, fmt), (fmt, value)
        if fmt in ("date", "date-time"):
            datetime.datetime.fromisoformat(value)  # raises on an impossible date
        if fmt == "time":
            datetime.time.fromisoformat(value)


def test_string_lengths_are_capped_but_valid() -> None:
    regex = string_length_regex(2, 100)
    assert full(regex, '"ab"') and full(regex, '"' + "x" * 32 + '"')
    assert not full(regex, '"a"') and not full(regex, '"' + "x" * 33 + '"')  # capped at 32
    # Unbounded above: a printable ASCII prefix of minLength, then any JSON string content.
    assert full(string_length_regex(1, None), '"aé\\n"')
    assert not full(string_length_regex(1, None), '""')


@pytest.mark.parametrize(
    "pattern,good,bad",
    [
        ("^[a-z]+$", ["abc"], ["", "aB", "a1"]),
        (r"^\d{3}-\d{4}$", ["555-1234"], ["5555-123", "١٢٣-4567"]),
        ("^(foo|bar)baz$", ["foobaz", "barbaz"], ["baz"]),
        ('^a"b$', ['a\\"b'], ['a"b']),
        (r"^[^0-9]*$", ["ab c"], ["a1"]),
    ],
)
def test_pattern_regex_matches_the_json_encoding(
    pattern: str, good: list[str], bad: list[str]
) -> None:
    regex = pattern_string_regex(pattern)
    for text in good:
        assert full(regex, f'"{text}"'), (pattern, text, regex)
        value = json.loads(f'"{text}"')
        assert re.search(pattern, value)
    for text in bad:
        assert not full(regex, f'"{text}"'), (pattern, text, regex)


@pytest.mark.parametrize(
    "pattern,needle",
    [("(?=a)b", "lookahead"), (r"(a)\1", "backreference"), ("(?i)abc", "flags"), ("a(", "syntax")],
)
def test_pattern_regex_refuses_what_a_regular_grammar_cannot_do(pattern: str, needle: str) -> None:
    with pytest.raises(GrammarError, match=needle):
        pattern_string_regex(pattern)


# --------------------------------------------------------------------------- lowering


PERSON = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
    "required": ["name", "age"],
}


def test_person_schema_accepts_valid_and_rejects_invalid() -> None:
    regex = schema_to_regex(PERSON).regex
    good = [{"name": "Al", "age": 3}, {"name": "Al", "age": 150, "email": "a@b.co", "tags": ["x"]}]
    bad = [{"name": "Al"}, {"name": "Al", "age": -1}, {"name": "Al", "age": 3, "tags": ["x", "x"]}]
    for doc in good:
        assert accepts_text(regex, json.dumps(doc, separators=(",", ":")))
        assert accepts_text(regex, json.dumps(doc))  # one space after , and : is allowed
    for doc in bad:
        assert not accepts_text(regex, json.dumps(doc, separators=(",", ":")))
    assert not accepts_text(regex, '{"name":"Al",  "age":3}')  # whitespace is bounded


def test_refs_recursion_and_allof_are_resolved() -> None:
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["v"],
            },
            "named": {"properties": {"name": {"const": "x"}}, "required": ["name"]},
        },
        "allOf": [{"$ref": "#/$defs/node"}, {"$ref": "#/$defs/named"}],
    }  # fmt: skip
    regex = schema_to_regex(schema).regex
    assert accepts_text(regex, '{"v":1,"kids":[{"v":2}],"name":"x"}')
    assert not accepts_text(regex, '{"v":1}')  # allOf: name is required too
    assert not accepts_text(regex, '{"v":1,"name":"y"}')


@pytest.mark.parametrize(
    "schema,needle",
    [
        ({"not": {"minimum": 3}}, "'not'"),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, "'if'"),
        ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
        ({"dependentSchemas": {"a": {"required": ["b"]}}, "properties": {"a": {}}},
         "'dependentSchemas'"),
        ({"$dynamicRef": "#meta"}, "'\\$dynamicRef'"),
        ({"type": "integer", "multipleOf": 3}, "'multipleOf'"),
        ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "'oneOf'"),
        ({"$ref": "https://example.com/other.json"}, "external \\$ref"),
        ({"type": "string", "pattern": "^(ab)+$", "maxLength": 3}, "'pattern' together"),
    ],
)  # fmt: skip
def test_unsupported_keywords_raise_a_grammar_error_naming_them(schema, needle: str) -> None:
    with pytest.raises(GrammarError, match=needle):
        json_schema_grammar(schema)


@pytest.mark.parametrize(
    "schema,needle",
    [({"type": 5}, "expected a valid JSON Schema"), ([1, 2], "expected a JSON Schema"),
     ({"enum": []}, "no JSON value satisfies it"), (False, "no JSON value satisfies it")],
)  # fmt: skip
def test_not_a_schema(schema, needle: str) -> None:
    with pytest.raises(GrammarError, match=needle):
        json_schema_grammar(schema)


def test_simple_not_and_exclusive_oneof() -> None:
    regex = schema_to_regex({"not": {"type": ["string", "object", "array"]}}).regex
    assert accepts_text(regex, "1") and accepts_text(regex, "null")
    assert not accepts_text(regex, '"a"') and not accepts_text(regex, "[]")
    # Required sets that are not subsets of each other: each branch drops the optional
    # properties the other requires, so no output matches both.
    one = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    regex = schema_to_regex(one).regex
    assert accepts_text(regex, '{"a":1}') and accepts_text(regex, '{"b":2}')
    assert not accepts_text(regex, '{"a":1,"b":2}')
    with pytest.raises(GrammarError, match="branches 0 and 1 may both match"):
        schema_to_regex({"oneOf": [{"enum": ["x"]}, {"type": "string"}]})


def test_any_value_is_wrapped_and_shallow() -> None:
    # outlines-core's own regex for {} is an unparenthesized alternation: inside a tuple it
    # swallowed its neighbours and accepted [1,2] for one item.
    regex = schema_to_regex({"prefixItems": [{}], "items": False}).regex
    assert accepts_text(regex, "[1]") and accepts_text(regex, '[{"a":1}]')
    assert not accepts_text(regex, "[1,2]")
    assert not accepts_text(regex, '[{"a":[1]}]')  # "any" nests one level only


def test_narrowing_is_reported() -> None:
    grammar = json_schema_grammar(PERSON)
    assert any("maxLength 40 lowered to 32" in n for n in grammar.notes)
    assert any("uniqueItems" in n for n in grammar.notes)


def test_validate_json_reports_one_line() -> None:
    assert validate_json('{"name":"Al","age":3}', PERSON) is None
    assert "not JSON" in validate_json("{", PERSON)
    assert "age" in validate_json('{"name":"Al"}', PERSON)


# --------------------------------------------------------------------------- test suite


# The suite's draft 2020-12 files of the keywords below, in its layout (tests/data/.../README.md).
FIXTURE_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture()
def suite(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The subset's draft 2020-12 folder, found as the bench finds it: through $QUANTKIT_DATA."""
    monkeypatch.delenv(SUITE_ENV, raising=False)
    monkeypatch.setenv(DATA_ENV, str(FIXTURE_DATA))
    folder = default_suite_dir() / "tests" / "draft2020-12"
    assert folder == FIXTURE_DATA / "json-schema-test-suite" / "tests" / "draft2020-12"
    return folder


def test_json_schema_test_suite_subset_is_sound(suite: Path) -> None:
    keywords = ["type", "properties", "required", "enum", "const", "minimum", "maximum",
                "allOf", "anyOf", "oneOf", "items", "prefixItems", "uniqueItems", "ref",
                "additionalProperties", "unevaluatedProperties", "maxLength", "pattern",
                "dependentRequired", "propertyNames", "not", "contains"]  # fmt: skip
    reports = {r.keyword: r for r in run_suite(suite, files=keywords)}
    assert sorted(reports) == sorted(keywords)  # every keyword's file was there and was read
    assert sum(r.invalid - r.invalid_rejected for r in reports.values()) == 0, [
        u for r in reports.values() for u in r.unsound
    ]
    for name in ["type", "properties", "required", "enum", "minimum", "items", "ref"]:
        assert reports[name].compiled >= reports[name].groups // 2, name
    assert reports["contains"].compiled == 0
    assert all("keyword 'contains'" in e for e in reports["contains"].errors)
    assert reports["not"].errors and all(
        "keyword 'not'" in e or "no JSON value satisfies it" in e for e in reports["not"].errors
    )


def test_suite_dir_comes_from_the_variables_or_the_error_names_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    monkeypatch.setenv(SUITE_ENV, str(tmp_path))
    assert default_suite_dir() == tmp_path
    monkeypatch.delenv(SUITE_ENV)
    assert default_suite_dir() == tmp_path / "data" / "json-schema-test-suite"
    monkeypatch.delenv(DATA_ENV)
    with pytest.raises(EvalError) as err:
        default_suite_dir()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("no JSON-Schema-Test-Suite data: pass --data DIR")
    assert SUITE_ENV in msg and DATA_ENV in msg
    assert main([]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"
