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

- `uniqueItems: true` (llguidance: "Unimplemented keys"): `unique_items_bounded` allows at most
  one item (zero or one items are always unique), with a note, as outlines-core's lowering
  does; None when minItems > 1 (then nothing sound is left).

Not done, on purpose: dropping a `format` llguidance does not know ("Unknown format: byte").
JSON Schema 2020-12 makes `format` an annotation, but the benchmark's invalid instances include
ones invalid only by format (MCPspec CompleteRequest, uri-template): dropping it accepted one.

Measured on JSONSchemaBench (225 schemas): 14 of llguidance's refusals were oneOf; 7 of them
are proven exclusive here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import combinations
from typing import Any

__all__ = [
    "one_of_exclusive",
    "ref_siblings_dropped",
    "simplify_not",
    "unique_items_bounded",
    "without_dependencies",
]

_ALL_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SKIP = ("enum", "const", "default", "examples")  # JSON values, not schemas


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
    if a is None or b is None or depth > 6:
        return False
    types_a, types_b = _types(a) & context, _types(b) & context
    if not (types_a & types_b):
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not (values_a & values_b):
        return True
    if types_a | types_b != {"object"}:  # the object rules below separate objects only
        return False
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    required = {*(a.get("required") or []), *(b.get("required") or [])}
    for name in required & props_a.keys() & props_b.keys():
        if _disjoint(props_a[name], props_b[name], root, _ALL_TYPES, depth + 1):
            return True
    return _closed_without(a, b) or _closed_without(b, a)


def _closed_without(a: Any, b: Any) -> bool:
    """`a` requires a property that closed `b` (additionalProperties false, no patterns) does
    not declare: no object satisfies both."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if b.get("additionalProperties", True) is not False or b.get("patternProperties"):
        return False
    declared = set(b.get("properties") or {})
    return any(name not in declared for name in a.get("required") or [])


def one_of_exclusive(schema: Any) -> bool:
    """Whether every `oneOf` in `schema` has pairwise disjoint branches (so anyOf == oneOf)."""
    found: list[tuple[list[Any], frozenset[str]]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("oneOf"), list):  # the types beside it bound its branches
                found.append((node["oneOf"], _types({k: v for k, v in node.items() if k in
                                                     ("type",)})))  # fmt: skip
            for k, v in node.items():
                if k not in _SKIP:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
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

    return _rewrite_bottom_up(schema, fix)


def _rewrite_bottom_up(
    schema: Any, fix: Callable[[dict[str, Any], str, list[str]], dict[str, Any]]
) -> tuple[Any, list[str]] | None:
    """`schema` with `fix(node, where, notes)` applied to every subschema object, children
    first (JSON values under `_SKIP` keys untouched), and the notes it made; None when `fix`
    raised `_Unsound`."""
    notes: list[str] = []

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{where}/{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in _SKIP else walk(v, f"{where}/{k}") for k, v in node.items()}
        return fix(out, where, notes)

    try:
        return walk(schema, "#"), notes
    except _Unsound:
        return None


class _Unsound(Exception):
    """A dependency rewrite that would not be sound."""


def simplify_not(node: Any) -> Any:
    """`node` with every `{"not": {}}` / `{"not": true}` as false and `{"not": false}` as true
    (exact rewrites: the subschema has no other keyword)."""
    if isinstance(node, list):
        return [simplify_not(v) for v in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"not"} and node["not"] in ({}, True, False):
        return node["not"] is False
    return {k: v if k in _SKIP else simplify_not(v) for k, v in node.items()}


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


def unique_items_bounded(schema: Any) -> tuple[Any, list[str]] | None:
    """`schema` with every `uniqueItems: true` array bounded to one item (noted); None when an
    array needs more items."""

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        if out.pop("uniqueItems", False) is True:
            if out.get("minItems", 0) > 1:
                raise _Unsound
            out["maxItems"] = min(out.get("maxItems", 1), 1)
            notes.append(f"{where}: uniqueItems: at most one item produced")
        return out

    return _rewrite_bottom_up(schema, fix)
