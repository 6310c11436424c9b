"""What a user can constrain generation to: a JSON schema, a regex, a choice of strings, or a
context-free grammar in Lark syntax.

Each becomes a `Grammar`: the schema (llguidance's input), one regex over the output text
(outlines-core's input) or the Lark text (llguidance's only: `cfg` reads it from a file, GBNF
converted), plus what is needed to check and explain the result (the schema for validation,
notes on where the grammar is narrower than the schema). `schema_grammar` leaves the
regex to be lowered later, only if outlines-core is the engine, under the compile time limit
(`lowering`); `json_schema_grammar` lowers at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.outlines.schema_regex.json_schema import (
    WHITESPACE,
    check_schema,
    schema_to_regex,
)
from quantkit.grammar.outlines.schema_regex.regex_parts import escape_literal

__all__ = [
    "Grammar",
    "choice_grammar",
    "json_schema_grammar",
    "lark_grammar",
    "load_schema_file",
    "regex_grammar",
    "schema_grammar",
    "validate_json",
]


@dataclass(frozen=True)
class Grammar:
    """kind: "json_schema", "regex", "choice" or "lark"; regex: what outlines-core compiles
    (None for a schema not lowered yet, see `lowering.lower_schema`, and for a Lark grammar,
    which no regex can express); label: a short description for messages; schema: the parsed
    schema (json_schema only); notes: where the grammar is narrower than the schema (still
    sound), for the user; lark: the Lark text llguidance compiles (lark only); json_text: see
    the field."""

    kind: str
    regex: str | None
    label: str
    schema: Any = None
    notes: tuple[str, ...] = ()
    lark: str | None = None
    # A Lark grammar whose every `"`, `{` and `[` is JSON's (tool calls constrained from the
    # first token): its rows get the JSON checks too (distinct keys, runaways).
    json_text: bool = False


def read_option_file(option: str, path: Path, kind: str) -> str:
    """The text of the file an option names; GrammarError if it cannot be read or is not
    UTF-8 (`kind` says what was expected)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise GrammarError(f"{option} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise GrammarError(f"{option} {path}: expected {kind}, got binary data") from None


def load_schema_file(path: str | Path) -> Any:
    """The parsed JSON of a schema file; GrammarError if it cannot be read or is not JSON."""
    path = Path(path)
    text = read_option_file("--schema", path, "UTF-8 JSON text")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(
            f"--schema {path}: expected a JSON file, got invalid JSON at line {e.lineno} "
            f"column {e.colno}: {e.msg}"
        ) from None


def json_schema_grammar(
    schema: Any, *, label: str = "schema", whitespace: str = WHITESPACE
) -> Grammar:
    """A grammar for JSON documents valid against `schema` (parsed JSON or JSON text)."""
    lowered = schema_to_regex(schema, whitespace=whitespace)
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    return Grammar("json_schema", lowered.regex, label, schema=parsed, notes=lowered.notes)


def schema_grammar(schema: Any, *, label: str = "schema") -> Grammar:
    """A grammar for JSON documents valid against `schema`, checked against its metaschema but
    not lowered to a regex (llguidance compiles the schema itself)."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    check_schema(parsed)
    return Grammar("json_schema", None, label, schema=parsed)


def regex_grammar(pattern: str) -> Grammar:
    """A grammar for texts that fully match `pattern` (outlines-core / Rust regex syntax).

    Python's parser checks it first, so a plain syntax error gets a readable message; a pattern
    Python reads but Rust does not (lookarounds, backreferences) fails when compiled.
    """
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"--regex: expected a non-empty pattern, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise GrammarError(f"--regex {pattern!r}: expected a valid regex, got {e}") from None
    return Grammar("regex", pattern, f"regex {pattern!r}")


def choice_grammar(options: Sequence[str]) -> Grammar:
    """A grammar for exactly one of `options` (verbatim text)."""
    options = list(options)
    if not options or not all(isinstance(o, str) and o for o in options):
        raise GrammarError(f"--choice: expected one or more non-empty strings, got {options!r}")
    if len(set(options)) != len(options):
        dup = next(o for o in options if options.count(o) > 1)
        raise GrammarError(f"--choice: expected distinct options, got {dup!r} twice")
    # Longest first: the automaton is leftmost-first (see regex_parts.json_literal_regex).
    ordered = sorted(options, key=lambda o: (-len(o), o))
    regex = "(?:" + "|".join(escape_literal(o) for o in ordered) + ")"
    return Grammar("choice", regex, f"choice of {len(options)}")


def lark_grammar(text: str, *, label: str = "grammar") -> Grammar:
    """A grammar for the texts `text` (a Lark grammar in llguidance's dialect) derives from its
    `start` rule. Only emptiness is checked here: llguidance reads the syntax when it compiles
    (`cfg.load_grammar_file` checks it earlier, under the time limit)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{label}: expected a non-empty Lark grammar, got {text!r}")
    return Grammar("lark", None, label, lark=text)


def validate_json(text: str, schema: Any) -> str | None:
    """None if `text` parses as JSON and validates against `schema` (formats checked where
    jsonschema can), else a one-line reason."""
    from jsonschema import exceptions

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e.msg} at column {e.colno}"
    cls = check_schema(schema)
    error = exceptions.best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"invalid at {where}: {error.message}"
