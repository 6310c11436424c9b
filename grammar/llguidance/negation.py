"""`not` without `not`: a schema for (a sound part of) the values a schema rejects.

llguidance implements neither `not` nor `if`/`then`/`else` (both need the complement of a
subschema), and outlines-core's lowering only the simplest `not`s. `negation(node, root)` writes
the complement with positive keywords, one keyword at a time: a schema is the conjunction of its
keywords, so its complement is the union (anyOf) of the keywords' complements, each confined to
the JSON type the keyword constrains (`minimum: 3` fails only numbers below 3; a string passes).

Exact for: `type` (except excluding integers from numbers), `const`/`enum` (other values of the
same types: numbers as open intervals between the values, booleans, null; strings, arrays and
objects only when the enum has none of that type), number bounds, string and array lengths,
property counts, `required`, `properties` (recursively), `anyOf`, `allOf`, `not`, local `$ref`,
a `pattern` of the form `^[class]*$` / `^[class]+$`, and annotations. Every other assertion
(`pattern` in general, `format`, `multipleOf`, `items`, `additionalProperties`, `oneOf`, ...)
contributes nothing to the union: the result is then a strict subset of the complement (sound,
never larger), and `exact` is False so the caller reports the narrowing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Negation", "negation"]

_TYPES = ("null", "boolean", "object", "array", "number", "string")
# Keywords that never constrain a value: leaving them out of the complement is exact.
_ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$comment", "$defs", "definitions", "title",
    "description", "default", "examples", "readOnly", "writeOnly", "deprecated",
    "contentMediaType", "contentEncoding", "$vocabulary", "$dynamicAnchor", "$recursiveAnchor",
})  # fmt: skip
# Every assertion keyword of drafts 3 to 2020-12: anything else is an annotation (ignored by
# validators, so exact to ignore here too).
_ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items", "prefixItems",
    "additionalItems", "contains", "minContains", "maxContains", "maxItems", "minItems",
    "uniqueItems", "unevaluatedItems", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "dependencies", "dependentRequired", "dependentSchemas", "required",
    "maxProperties", "minProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not",
    "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef", "divisibleBy", "disallow",
    "extends",
})  # fmt: skip
_MAX_DEPTH = 6
_MAX_CHARS = 200_000  # a larger complement would cost llguidance more than it is worth
_CLASS_ONLY = re.compile(r"\^\[((?:[^\\\]]|\\.)+)\]([*+])\$")


@dataclass(frozen=True)
class Negation:
    """`schema` admits only values `node` rejects; `exact`: all of them."""

    schema: Any
    exact: bool


def negation(node: Any, root: Any, depth: int = 0) -> Negation:
    """The complement of `node` (a subschema of `root`, whose local `$ref`s it may follow) as a
    schema without `not`; see the module docstring for where it is exact."""
    if node is True or node == {}:
        return Negation(False, True)
    if node is False:
        return Negation(True, True)
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return Negation(False, False)
    branches: list[Any] = []
    exact = True
    for key in node:
        if key in _ANNOTATIONS or key not in _ASSERTIONS:
            continue
        part = _KEYWORDS.get(key)
        found = part(node, root, depth) if part else None
        if found is None:
            exact = False
            continue
        branches += found.schema
        exact = exact and found.exact
    branches = [b for b in branches if b is not False]
    if len(json.dumps(branches)) > _MAX_CHARS:
        return Negation(False, False)
    if not branches:
        return Negation(False, exact)
    return Negation(branches[0] if len(branches) == 1 else {"anyOf": branches}, exact)


def _types(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {dict: "object", list: "array", str: "string"}.get(type(value), "null")


def _type(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    kinds = node["type"]
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    if not kinds <= {*_TYPES, "integer"}:
        return None
    if "integer" in kinds and "number" not in kinds:  # the fractional numbers are left out
        return Negation([{"type": [t for t in _TYPES if t not in kinds | {"number"}]}], False)
    rest = [t for t in _TYPES if t not in kinds]
    return Negation([{"type": rest}] if rest else [], True)


def _values(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    values = [node["const"]] if "const" in node else node["enum"]
    if not isinstance(values, list):
        return None
    by_type: dict[str, list[Any]] = {}
    for value in values:
        by_type.setdefault(_types(value), []).append(value)
    out: list[Any] = [{"type": [t for t in _TYPES if t not in by_type]}]
    exact = True
    if "boolean" in by_type and len(set(by_type["boolean"])) == 1:
        out.append({"const": not by_type["boolean"][0]})
    if "number" in by_type:
        out.append({"type": "number", "anyOf": _gaps(sorted(set(by_type["number"])))})
    others = _other_strings(by_type.get("string", []))
    if others is not None:
        out.append({"type": "string", "pattern": others})
    exact = not ({"object", "array"} & by_type.keys()) and (others is not None) == (
        "string" in by_type
    )
    if len(by_type) == len(_TYPES):
        out = out[1:]
    return Negation(out, exact)


def _other_strings(strings: list[str]) -> str | None:
    """A pattern matching exactly the strings not in `strings` (None when there are none, or
    a character outside the basic plane, which ECMA regexes count twice): along the trie of
    `strings`, every prefix that is not one of them, and every way to leave the trie."""
    if not strings or any(ord(c) > 0xFFFF for s in strings for c in s):
        return None
    trie: dict[str, Any] = {}
    for text in strings:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # the end of a member
    options: list[str] = []

    def visit(prefix: str, node: dict[str, Any]) -> None:
        if "" not in node:
            options.append(_escaped(prefix))
        chars = sorted(c for c in node if c)
        if chars:
            leave = "".join(_escaped(c, in_class=True) for c in chars)
            options.append(f"{_escaped(prefix)}[^{leave}][\\s\\S]*")
        else:
            options.append(f"{_escaped(prefix)}[\\s\\S]+")
        for char in chars:
            visit(prefix + char, node[char])

    visit("", trie)
    return f"^(?:{'|'.join(options)})$"


def _escaped(text: str, *, in_class: bool = False) -> str:
    special = "\\]^-[" if in_class else "\\^$.|?*+()[]{}/"
    return "".join(f"\\{c}" if c in special else _control(c) for c in text)


def _control(char: str) -> str:
    return f"\\u{ord(char):04x}" if ord(char) < 0x20 or char == "\x7f" else char


def _gaps(numbers: list[float]) -> list[dict[str, Any]]:
    """The numbers strictly between (and beyond) `numbers` (sorted), as bounds."""
    gaps: list[dict[str, Any]] = [{"exclusiveMaximum": numbers[0]}]
    for low, high in zip(numbers, numbers[1:], strict=False):
        gaps.append({"exclusiveMinimum": low, "exclusiveMaximum": high})
    return [*gaps, {"exclusiveMinimum": numbers[-1]}]


def _bound(node: dict[str, Any], key: str) -> Negation | None:
    """One number bound, flipped (draft 4's boolean exclusive flags included)."""
    value = node[key]
    if isinstance(value, bool):  # draft 4's flag: read with minimum/maximum (or no bound)
        return Negation([], True)
    if not isinstance(value, int | float):
        return None
    if key in ("minimum", "maximum"):
        flag = node.get("exclusive" + key[:1].upper() + key[1:])
        strict = flag is True  # draft 4: the bound itself is excluded
        flipped = {"minimum": ("maximum", "exclusiveMaximum"), "maximum": ("minimum",
                   "exclusiveMinimum")}[key][0 if strict else 1]  # fmt: skip
    else:
        flipped = {"exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}[key]
    return Negation([{"type": "number", flipped: value}], True)


def _count(kind: str, low: str, high: str) -> Any:
    def flip(node: dict[str, Any], root: Any, depth: int, key: str) -> Negation | None:
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        if key == low:
            return Negation([{"type": kind, high: value - 1}] if value > 0 else [], True)
        return Negation([{"type": kind, low: value + 1}], True)

    return flip


def _pattern(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    """`^[class]*$` fails exactly the strings holding another character (and `+` also ""); any
    other pattern: nothing (None)."""
    pattern = node["pattern"]
    match = _CLASS_ONLY.fullmatch(pattern) if isinstance(pattern, str) else None
    if match is None or match.group(1).startswith("^"):
        return None
    other = {"type": "string", "pattern": f"[^{match.group(1)}]"}
    empty = [{"type": "string", "maxLength": 0}] if match.group(2) == "+" else []
    return Negation([other, *empty], True)


def _required(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    names = node["required"]
    if not isinstance(names, list):
        return None
    return Negation([{"type": "object", "properties": {n: False}} for n in names], True)


def _properties(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    props = node["properties"]
    if not isinstance(props, dict):
        return None
    out, exact = [], True
    for name, sub in props.items():
        negated = negation(sub, root, depth + 1)
        exact = exact and negated.exact
        if negated.schema is not False:
            out.append({"type": "object", "required": [name], "properties": {name: negated.schema}})
    return Negation(out, exact)


def _any_of(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    if not isinstance(node["anyOf"], list):
        return None
    parts = [negation(b, root, depth + 1) for b in node["anyOf"]]
    if any(p.schema is False for p in parts):
        return Negation([], all(p.exact for p in parts))
    return Negation([{"allOf": [p.schema for p in parts]}], all(p.exact for p in parts))


def _all_of(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    if not isinstance(node["allOf"], list):
        return None
    parts = [negation(b, root, depth + 1) for b in node["allOf"]]
    return Negation([p.schema for p in parts], all(p.exact for p in parts))


def _not(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    return Negation([node["not"]], True)


def _ref(node: dict[str, Any], root: Any, depth: int) -> Negation | None:
    target = _resolve(root, node["$ref"])
    if target is None:
        return None
    negated = negation(target, root, depth + 1)
    return Negation([negated.schema], negated.exact)


def _resolve(root: Any, ref: Any) -> Any:
    """The subschema a local `$ref` (#/a/b) points to, None for any other."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and part in target:
            target = target[part]
        else:
            return None
    return target


def _keyword(key: str) -> Any:
    return lambda node, root, depth: _bound(node, key)


def _counted(flip: Any, key: str) -> Any:
    return lambda node, root, depth: flip(node, root, depth, key)


_strings, _arrays, _objects = (_count("string", "minLength", "maxLength"),
                               _count("array", "minItems", "maxItems"),
                               _count("object", "minProperties", "maxProperties"))  # fmt: skip
_KEYWORDS: dict[str, Any] = {
    "type": _type,
    "enum": _values,
    "const": _values,
    "pattern": _pattern,
    "required": _required,
    "properties": _properties,
    "anyOf": _any_of,
    "allOf": _all_of,
    "not": _not,
    "$ref": _ref,
    **{k: _keyword(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")},
    **{k: _counted(_strings, k) for k in ("minLength", "maxLength")},
    **{k: _counted(_arrays, k) for k in ("minItems", "maxItems")},
    **{k: _counted(_objects, k) for k in ("minProperties", "maxProperties")},
}
