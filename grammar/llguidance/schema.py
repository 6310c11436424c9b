"""Preparing a schema for llguidance without losing soundness.

- `oneOf`: llguidance refuses it unless told to read it as `anyOf` (`coerce_one_of`), which is
  unsound when a value can match two branches (oneOf then rejects it). `one_of_exclusive`
  proves the branches pairwise disjoint for the common shapes (different JSON types, or a
  required discriminator property with disjoint const/enum values); then anyOf accepts exactly
  the same values and coercion is exact. Otherwise the schema goes to the other engine (auto).

- `dependencies` / `dependentRequired` / `dependentSchemas` (llguidance: "Unimplemented keys"):
  `without_dependencies` rewrites them into a narrower schema that only admits valid values,
  with a note each: a property's required companions become required always (as
  outlines-core's lowering does), and a property with a dependent schema is never produced
  (unless it is required: then the schema is left to the other engine).

- `{"not": {}}` (llguidance: "Unimplemented keys: not"): matches nothing, so it is exactly the
  `false` schema (a property that must be absent); `simplify_not` rewrites it, and
  `{"not": false}` to `true`.

- keywords beside a `$ref` in a draft-04/06/07 schema (llguidance: "circular references with
  sibling keys are not supported"): those drafts ignore them, so `ref_siblings_dropped`
  removes them (exact; definitions kept, as references may point into them).

- `uniqueItems: true` (llguidance: "Unimplemented keys"): `unique_items_listed` lists the
  arrays of a few constants exactly (an enum of arrays) and drops the keyword elsewhere; the
  rows then check distinct items on the document's text (`distinct_items`).

- a `format` llguidance does not know ("Unknown format"): `formats_written` writes the ones a
  pattern can hold as that pattern: `byte` (OpenAPI's base64 text) exactly, `regex` as the
  regexes without special characters (every such string is a valid regex; noted, narrower).
  A format no JSON Schema draft defines (`topic`, `url`, `int64`, ...) is an annotation that
  no validator checks (2020-12: unknown formats are ignored), so it is dropped, with a note, as
  outlines-core's lowering does. A defined one llguidance does not implement (`uri-template`,
  `iri`, ...) stays a refusal: validators check those, and the benchmark's invalid instances
  include ones invalid only by such a format (MCPspec CompleteRequest, uri-template), which
  dropping it accepted.

Measured on JSONSchemaBench (225 schemas): 14 of llguidance's refusals were oneOf; 7 of them
are proven exclusive here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from itertools import combinations, permutations
from math import perm
from typing import Any

from quantkit.grammar.llguidance.distinct_items import all_arrays_unique
from quantkit.grammar.llguidance.negation import negation

__all__ = [
    "formats_written",
    "llguidance_schema",
    "one_of_exclusive",
    "ref_siblings_dropped",
    "rewrite_bottom_up",
    "schema_nodes",
    "simplify_not",
    "unique_items_listed",
    "without_dependencies",
    "without_negation",
]

_ALL_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SKIP = ("enum", "const", "default", "examples")  # JSON values, not schemas
# Maps of names to subschemas (or, in `dependencies`, to lists of names).
_NAME_MAPS = frozenset({"properties", "patternProperties", "definitions", "$defs",
                        "dependentSchemas", "dependencies"})  # fmt: skip


def _resolve(root: Any, node: Any, depth: int = 0) -> Any:
    """Follow a local `$ref` (#/a/b) a few levels; anything else is returned as it is."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < 8:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return None
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        node, depth = target, depth + 1
    return node


def _types(node: Any) -> frozenset[str]:
    """The JSON types `node` can accept (all of them when it does not say)."""
    if not isinstance(node, dict):
        return _ALL_TYPES
    kind = node.get("type")
    if isinstance(kind, str):
        kinds = {kind}
    elif isinstance(kind, list):
        kinds = set(kind)
    elif "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else list(node.get("enum") or [])
        kinds = {_type_of(v) for v in values}
    else:
        return _ALL_TYPES
    if "number" in kinds:
        kinds.add("integer")  # 1 is a number too: integer overlaps number
    return frozenset(kinds)


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {dict: "object", list: "array", str: "string", float: "number"}.get(type(value), "null")


def _values(node: Any) -> set[str] | None:
    """The JSON texts a const/enum allows, or None without one."""
    if not isinstance(node, dict) or not ("const" in node or "enum" in node):
        return None
    values = [node["const"]] if "const" in node else list(node.get("enum") or [])
    return {_key(v) for v in values}


def _key(value: Any) -> str:
    """A JSON value's text, with 1.0 and 1 (equal in JSON Schema) written the same."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _disjoint(
    a: Any, b: Any, root: Any, context: frozenset[str] = _ALL_TYPES, depth: int = 0
) -> bool:
    """No value satisfies both `a` and `b` (within the types `context` allows): different
    types, disjoint const/enum values, or, for objects, a property one of them requires whose
    two schemas are disjoint (recursively), or one closed object lacking the other's required
    property. False when none of these is proven."""
    a, b = _resolve(root, a), _resolve(root, b)
    if a is False or b is False:  # matches nothing: disjoint from anything
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 6:
        return False
    types_a, types_b = _types(a) & context, _types(b) & context
    if not (types_a & types_b):
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not (values_a & values_b):
        return True
    if _none_valid(a, b, root) or _none_valid(b, a, root):
        return True
    if types_a | types_b != {"object"}:  # the object rules below separate objects only
        return False
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    required = {*(a.get("required") or []), *(b.get("required") or [])}
    for name in required & props_a.keys() & props_b.keys():
        if _disjoint(props_a[name], props_b[name], root, _ALL_TYPES, depth + 1):
            return True
    return _closed_without(a, b) or _closed_without(b, a)


def _none_valid(a: dict[str, Any], b: Any, root: Any) -> bool:
    """`a` is a const/enum none of whose values `b` accepts (checked with jsonschema, `$ref`s
    resolved in `root`)."""
    if "const" not in a and "enum" not in a:
        return False
    values = [a["const"]] if "const" in a else a["enum"]
    if not isinstance(values, list) or len(values) > 1000:
        return False
    from jsonschema import Draft202012Validator, validators

    try:
        check = validators.validator_for(root, default=Draft202012Validator)(root).evolve(schema=b)
        return not any(check.is_valid(v) for v in values)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot read proves nothing
        return False


def _closed_without(a: Any, b: Any) -> bool:
    """`a` requires a property that closed `b` (additionalProperties false, no patterns) does
    not declare: no object satisfies both."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if b.get("additionalProperties", True) is not False or b.get("patternProperties"):
        return False
    declared = set(b.get("properties") or {})
    return any(name not in declared for name in a.get("required") or [])


def schema_nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Every object of `schema` (`node`), each before those inside it, in document order, not
    entering the keywords whose values are JSON data (`_SKIP`)."""
    if isinstance(node, dict):
        yield node
        for k, v in node.items():
            if k not in _SKIP:
                yield from schema_nodes(v)
    elif isinstance(node, list):
        for v in node:
            yield from schema_nodes(v)


def one_of_exclusive(schema: Any) -> bool:
    """Whether every `oneOf` in `schema` has pairwise disjoint branches (so anyOf == oneOf)."""
    # the types beside a oneOf bound its branches
    found = [(node["oneOf"], _types({k: v for k, v in node.items() if k in ("type",)}))
             for node in schema_nodes(schema) if isinstance(node.get("oneOf"), list)]  # fmt: skip
    for branches, context in found:
        if not all(_disjoint(a, b, schema, context) for a, b in combinations(branches, 2)):
            return False
    return True


_DEPENDENCY_KEYS = ("dependencies", "dependentRequired", "dependentSchemas")


def without_dependencies(schema: Any) -> tuple[Any, list[str]] | None:
    """`schema` with its dependency keywords rewritten (see the module docstring) and the notes
    saying how it narrowed; None when a rewrite would not be sound (a required property with a
    dependent schema)."""

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        deps = {}
        for key in _DEPENDENCY_KEYS:
            value = out.pop(key, None)
            if isinstance(value, dict):
                deps.update(value)
        if not deps:
            return out
        required = list(out.get("required") or [])
        props = dict(out.get("properties") or {})
        for name, dep in deps.items():
            if isinstance(dep, list):
                added = [d for d in dep if d not in required]
                if added:
                    required += added
                    notes.append(f"{where}: {added} made required (dependencies of {name!r})")
            elif dep not in (True, {}):
                if name in required:
                    raise _Unsound
                props[name] = False
                notes.append(f"{where}: property {name!r} is never produced (dependent schema)")
        if required:
            out["required"] = required
        if props:
            out["properties"] = props
        return out

    return rewrite_bottom_up(schema, fix)


def rewrite_bottom_up(
    schema: Any, fix: Callable[[dict[str, Any], str, list[str]], dict[str, Any]]
) -> tuple[Any, list[str]] | None:
    """`schema` with `fix(node, where, notes)` applied to every subschema object, children
    first (JSON values under `_SKIP` keys untouched; the maps of names to subschemas, such as
    `properties`, are not subschemas themselves: a property named `not` stays a name), and the
    notes it made; None when `fix` raised `_Unsound`."""
    notes: list[str] = []

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{where}/{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in _SKIP else child(k, v, f"{where}/{k}") for k, v in node.items()}
        return fix(out, where, notes)

    def child(key: str, value: Any, where: str) -> Any:
        if key in _NAME_MAPS and isinstance(value, dict):
            return {n: walk(v, f"{where}/{n}") for n, v in value.items()}
        return walk(value, where)

    try:
        return walk(schema, "#"), notes
    except _Unsound:
        return None


_MAX_ARRAYS = 400


def _distinct_arrays(node: dict[str, Any], root: Any) -> list[Any] | None:
    """Every array `node` accepts, when its items are a few constants (distinct items: at most
    as many as constants, so finitely many arrays); None otherwise or past `_MAX_ARRAYS`."""
    items = _resolve(root, node.get("items"))
    if "prefixItems" in node or not isinstance(items, dict):
        return None
    if items.get("type") == "boolean" and set(items) <= {"type", "title", "description"}:
        values: list[Any] = [True, False]
    elif "enum" in items or "const" in items:
        values = [items["const"]] if "const" in items else list(items["enum"])
    else:
        return None
    low, high = node.get("minItems", 0), min(node.get("maxItems", len(values)), len(values))
    if sum(perm(len(values), k) for k in range(low, high + 1)) > _MAX_ARRAYS:
        return None
    from jsonschema import Draft202012Validator, validators

    check = validators.validator_for(root, default=Draft202012Validator)(root).evolve(schema=node)
    arrays = [list(p) for k in range(low, high + 1) for p in permutations(values, k)]
    return [a for a in arrays if check.is_valid(a)]


class _Unsound(Exception):
    """A dependency rewrite that would not be sound."""


def llguidance_schema(schema: Any) -> tuple[Any, list[str]]:
    """`schema` as llguidance should get it, and where that is narrower (notes): the exact
    rewrites (`ref_siblings_dropped`, `simplify_not`) first, then `without_negation`'s narrowed
    ones (only what the exact ones left: a `not`, `if` or overlapping `oneOf` llguidance refuses
    anyway), and the formats it does not know (`formats_written`)."""
    schema, notes = without_negation(simplify_not(ref_siblings_dropped(schema)))
    schema, more = formats_written(schema)
    return schema, notes + more


# Formats llguidance does not know, as the pattern that holds them. byte: OpenAPI's base64
# (RFC 4648, padded). regex: no character with a special meaning in a regex, so the string
# matches itself literally and is a valid regex (narrower than every valid regex: noted).
_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_LITERAL_REGEX = r"^[^\\^$.|?*+()\[\]{}]*$"
_FORMAT_PATTERNS = {"byte": (_BASE64, None), "regex": (_LITERAL_REGEX, "regexes without "
                    "special characters (literal text) are produced")}  # fmt: skip


# llguidance's `date` takes year 0000 (RFC 3339 does, Python's date and so jsonschema's checker
# do not; a steered walk through a date wrote `0000-01-01`) and February 29 of any year (RFC
# 3339 does not). Every real date of the years 0001-9999, as a pattern beside the format.
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]"
              "[0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")  # fmt: skip
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE_PATTERN = f"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)$"
_YEAR_NOTE = "year 0000 is not produced (Python's date type and jsonschema's checker reject it)"

# The formats llguidance implements, and every format a JSON Schema draft (3 to 2020-12)
# defines; any other is an annotation (see the module docstring).
_LLG_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4",
                          "ipv6", "uri", "uuid"})  # fmt: skip
_DEFINED_FORMATS = _LLG_FORMATS | {
    "idn-email", "idn-hostname", "uri-reference", "iri", "iri-reference", "uri-template",
    "json-pointer", "relative-json-pointer", "regex", "host-name", "ip-address", "color",
    "style", "phone", "utc-millisec",
}  # fmt: skip


def formats_written(schema: Any) -> tuple[Any, list[str]]:
    """`schema` with each `format` of `_FORMAT_PATTERNS` (on a schema without a `pattern` of its
    own) as its pattern, a note for each narrowed one, and every format no draft defines
    dropped (an annotation: noted, not enforced)."""

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        fmt = out.get("format")
        if isinstance(fmt, str) and fmt not in _DEFINED_FORMATS and fmt not in _FORMAT_PATTERNS:
            notes.append(f"{where}: format {fmt!r} is not enforced (an annotation, as in 2020-12)")
            return {k: v for k, v in out.items() if k != "format"}
        if fmt == "date" and "pattern" not in out:  # format and pattern: llguidance takes both
            notes.append(f"{where}: format date: {_YEAR_NOTE}")
            return out | {"pattern": _DATE_PATTERN}
        written = _FORMAT_PATTERNS.get(out.get("format")) if "pattern" not in out else None
        if written is None:
            return out
        pattern, narrowed = written
        if narrowed is not None:
            notes.append(f"{where}: format {out['format']}: only {narrowed}")
        return {k: v for k, v in out.items() if k != "format"} | {"pattern": pattern}

    rewritten = rewrite_bottom_up(schema, fix)
    assert rewritten is not None  # the fix never raises _Unsound
    return rewritten


def simplify_not(node: Any) -> Any:
    """`node` with the rewrites of `without_negation` that are exact (no value gained or lost),
    and every `{"not": {}}` / `{"not": true}` as false and `{"not": false}` as true."""
    return without_negation(_trivial_nots(node), exact_only=True)[0]


def _trivial_nots(node: Any) -> Any:
    if isinstance(node, list):
        return [_trivial_nots(v) for v in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"not"} and node["not"] in ({}, True, False):
        return node["not"] is False
    return {k: v if k in _SKIP else _trivial_nots(v) for k, v in node.items()}


def without_negation(schema: Any, *, exact_only: bool = False) -> tuple[Any, list[str]]:
    """`schema` with `not`, `if`/`then`/`else` and the `oneOf`s not proven exclusive written
    with positive keywords (`negation`), and a note for each one that is narrower than
    the schema (exact_only: those are left as they are). A few passes, so a complement reached
    through a `$ref` sees the rewritten definitions."""
    notes: list[str] = []
    for _ in range(3):
        rewritten = rewrite_bottom_up(schema, _positive_keywords(schema, exact_only))
        assert rewritten is not None  # the fix never raises _Unsound
        schema, more = rewritten
        notes += more
        if not _has_keys(schema, ("not", "if")):
            break
    return schema, list(dict.fromkeys(notes))


def _positive_keywords(
    root: Any, exact_only: bool
) -> Callable[[dict[str, Any], str, list[str]], dict[str, Any]]:
    """The fix of one `without_negation` pass, following `$ref`s into `root`."""

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        out = _dependencies_rewritten(out)
        out = _negation_rewritten(out, root, where, notes, exact_only)
        out = _conditional_rewritten(out, root, where, notes, exact_only)
        return _one_of_rewritten(out, root, where, notes, exact_only)

    return fix


def _has_keys(node: Any, keys: tuple[str, ...]) -> bool:
    if isinstance(node, list):
        return any(_has_keys(v, keys) for v in node)
    if not isinstance(node, dict):
        return False
    return any(k in node for k in keys) or any(
        _has_keys(v, keys) for k, v in node.items() if k not in _SKIP
    )


def _conjoined(out: dict[str, Any], extra: Any) -> dict[str, Any]:
    """`out` that must also satisfy `extra` (appended to its allOf)."""
    if extra is True:
        return out
    return {**out, "allOf": [*(out.get("allOf") or []), extra]}


# llguidance expands the anyOfs it intersects: past a few per object it refuses ("schema too
# large", measured: JsonSchemaStore filespec, 6); those are left to `without_dependencies`.
_MAX_DEPENDENCIES = 3


def _dependencies_rewritten(out: dict[str, Any]) -> dict[str, Any]:
    """`out` with each dependency as anyOf[name absent, name present and its companions /
    schema] (exact; `without_dependencies` narrows instead, for what llguidance still refuses)."""
    deps: dict[str, Any] = {}
    for key in _DEPENDENCY_KEYS:
        value = out.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return out
        deps.update(value)
    if not deps or len(deps) > _MAX_DEPENDENCIES:
        return out
    out = {k: v for k, v in out.items() if k not in _DEPENDENCY_KEYS}
    for name, dep in deps.items():
        present: Any = {"required": [name, *dep]} if isinstance(dep, list) else {
            "allOf": [{"required": [name]}, dep]}  # fmt: skip
        out = _conjoined(out, {"anyOf": [{"properties": {name: False}}, present]})
    return out


def _negation_rewritten(
    out: dict[str, Any], root: Any, where: str, notes: list[str], exact_only: bool
) -> dict[str, Any]:
    """`out` with its `not` replaced by the complement of the negated subschema."""
    if "not" not in out:
        return out
    negated = negation(out["not"], root)
    if not negated.exact:
        if exact_only:
            return out
        notes.append(f"{where}: not: some values it allows are never produced (its complement "
                     f"is written without the keywords that have no positive form)")  # fmt: skip
    rest = {k: v for k, v in out.items() if k != "not"}
    return _conjoined(rest, negated.schema)


def _conditional_rewritten(
    out: dict[str, Any], root: Any, where: str, notes: list[str], exact_only: bool
) -> dict[str, Any]:
    """`out` with `if`/`then`/`else` as anyOf[allOf[if, then], allOf[not if, else]]."""
    if "if" not in out:
        return out
    rest = {k: v for k, v in out.items() if k not in ("if", "then", "else")}
    if "then" not in out and "else" not in out:  # no assertion at all
        return rest
    condition, then, other = out["if"], out.get("then", True), out.get("else", True)
    negated = negation(condition, root)
    if not negated.exact:
        if exact_only:
            return out
        notes.append(f"{where}: if/then/else: when the condition fails, only the values its "
                     f"written complement allows are produced")  # fmt: skip
    branches = [{"allOf": [condition, then]}, {"allOf": [negated.schema, other]}]
    return _conjoined(rest, {"anyOf": branches})


def _one_of_rewritten(
    out: dict[str, Any], root: Any, where: str, notes: list[str], exact_only: bool
) -> dict[str, Any]:
    """`out` with a oneOf not proven exclusive as anyOf[allOf[branch i, not branch j, ...]]
    (each branch joined by the complements of the branches it may overlap)."""
    branches = out.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return out
    context = _types({"type": out["type"]} if "type" in out else {})
    overlaps = [[j for j in range(len(branches)) if j != i and not _disjoint(
        branches[i], branches[j], root, context)] for i in range(len(branches))]  # fmt: skip
    if not any(overlaps):
        return out  # exclusive: read as anyOf (coerce_one_of)
    complements = {j: negation(branches[j], root) for o in overlaps for j in o}
    if not all(c.exact for c in complements.values()):
        if exact_only:
            return out
        notes.append(f"{where}: oneOf: some values matching exactly one branch are never "
                     f"produced (the others' complements are partly written)")  # fmt: skip
    joined = [{"allOf": [b, *(complements[j].schema for j in o)]} if o else b
              for b, o in zip(branches, overlaps, strict=True)]  # fmt: skip
    rest = {k: v for k, v in out.items() if k != "oneOf"}
    return _conjoined(rest, {"anyOf": joined})


_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
_KEEP_BESIDE_REF = ("$ref", "definitions", "$defs", "$id", "id")


def ref_siblings_dropped(schema: Any) -> Any:
    """For a draft-07-or-older schema, every `$ref` without the keywords beside it (which
    those drafts ignore); other schemas unchanged."""
    draft = schema.get("$schema", "") if isinstance(schema, dict) else ""
    if not (isinstance(draft, str) and any(d in draft for d in _OLD_DRAFTS)):
        return schema

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if isinstance(node.get("$ref"), str):
            node = {k: v for k, v in node.items() if k in _KEEP_BESIDE_REF}
        return {k: v if k in _SKIP else walk(v) for k, v in node.items()}

    return walk(schema)


def unique_items_listed(schema: Any) -> tuple[Any, list[str], bool]:
    """`schema` with every `uniqueItems: true` array whose items are a few constants (enum,
    const, boolean) as the enum of all its arrays (exact), and the keyword dropped from every
    other one; True when one was dropped: the rows then check distinct items on the text
    (`distinct_items`), noted where that reaches arrays the schema lets repeat items."""
    dropped: list[str] = []

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        if "uniqueItems" not in out:
            return out
        if out["uniqueItems"] is not True:  # false: no constraint (exact without it)
            return {k: v for k, v in out.items() if k != "uniqueItems"}
        arrays = _distinct_arrays(out, schema)
        if arrays is not None:  # exact: every array of distinct items, listed
            return {k: v for k, v in out.items() if k != "uniqueItems"} | {"enum": arrays}
        dropped.append(where)
        return {k: v for k, v in out.items() if k != "uniqueItems"}

    rewritten = rewrite_bottom_up(schema, fix)
    assert rewritten is not None  # the fix never raises _Unsound
    out, notes = rewritten
    if dropped and not all_arrays_unique(schema):
        notes.append(f"{dropped[0]}: uniqueItems is checked on every array of the document, so "
                     "arrays the schema lets repeat items hold distinct items too")  # fmt: skip
    return out, notes, bool(dropped)
