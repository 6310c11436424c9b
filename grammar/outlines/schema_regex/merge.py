"""`allOf` as one schema: the intersection of two raw schema objects, keyword by keyword.

outlines-core concatenates the regexes of `allOf` branches, which is only right for one branch;
quantkit merges the branches into one schema before lowering it. A merge is exact where the
keyword allows (bounds take the tighter value, `required` the union, `type` and `enum` the
intersection) and a GrammarError otherwise (two different `pattern`s: regexes do not intersect).
"""

from __future__ import annotations

import json
from typing import Any

from quantkit.errors import GrammarError

__all__ = ["ANNOTATIONS", "close_branch", "merge_schemas"]

# Keywords that never constrain a value; a merge keeps the first one seen.
ANNOTATIONS = frozenset(
    {
        "$schema", "$id", "id", "$comment", "$anchor", "$dynamicAnchor", "$vocabulary",
        "title", "description", "default", "examples", "example", "deprecated", "readOnly",
        "writeOnly", "contentMediaType", "contentEncoding", "contentSchema", "$defs",
        "definitions", "discriminator", "nullable", "markdownDescription", "errorMessage",
    }
)  # fmt: skip
_CLOSERS = ("additionalProperties", "unevaluatedProperties")
# Keywords that constrain a value; any other key is an annotation (the first one seen is kept).
CONSTRAINTS = frozenset(
    {
        "type", "enum", "const", "properties", "patternProperties", "additionalProperties",
        "required", "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
        "minProperties", "maxProperties", "unevaluatedProperties", "items", "prefixItems",
        "additionalItems", "unevaluatedItems", "contains", "minContains", "maxContains",
        "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf",
        "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
_LOWER_BOUNDS = {"minimum", "minLength", "minItems", "minProperties", "minContains"}
_UPPER_BOUNDS = {"maximum", "maxLength", "maxItems", "maxProperties", "maxContains"}


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _types(value: Any) -> set[str]:
    return {value} if isinstance(value, str) else set(value)


def _merge_types(a: Any, b: Any) -> list[str]:
    ta, tb = _types(a), _types(b)
    out = ta & tb
    # integer is a subtype of number: number & integer = integer.
    if "number" in ta and "integer" in tb or "integer" in ta and "number" in tb:
        out.add("integer")
    return sorted(out)


def _check_extra_names(a: dict[str, Any], b: dict[str, Any], where: str, parent: bool) -> None:
    """A schema that closes its object (additionalProperties or unevaluatedProperties other
    than true) also judges the names only the other one declares; quantkit does not resolve
    that, so it refuses. Exception: a parent's unevaluatedProperties sees the properties its
    applicators (allOf, $ref, anyOf) evaluate, so there they are allowed."""
    for closed, other, keys in (
        (a, b, ("additionalProperties",) if parent else _CLOSERS),
        (b, a, _CLOSERS),
    ):
        for key in keys:
            extra = closed.get(key, True)
            if extra is True or extra == {}:
                continue
            names = set(other.get("properties", {})) | set(other.get("required", []))
            outside = names - set(closed.get("properties", {}))
            if outside:
                raise GrammarError(
                    f"{where}: allOf/$ref where one schema restricts {key} and another "
                    f"declares other properties ({sorted(outside)[:3]}) is not supported"
                )


def _merge_exclusive(a: Any, b: Any, key: str, where: str) -> Any:
    if isinstance(a, bool) or isinstance(b, bool):  # draft-4 boolean form
        if isinstance(a, bool) and isinstance(b, bool):
            return a or b
        raise GrammarError(f"{where}: allOf mixes boolean and numeric {key}")
    return max(a, b) if key == "exclusiveMinimum" else min(a, b)


def close_branch(schema: Any) -> Any:
    """A branch (an allOf member, a $ref target) whose `unevaluatedProperties`/`Items` are
    restated as `additionalProperties`/`items`, once its own applicators are merged in.

    They mean the same inside the branch, but unlike the originals they must not look at what
    the branch's parent or siblings evaluate; restating them keeps a later merge from treating
    them as the parent's own (which may legally see its applicators' properties).
    """
    if not isinstance(schema, dict) or {"anyOf", "oneOf", "allOf", "$ref"} & set(schema):
        return schema
    out = dict(schema)
    if "unevaluatedProperties" in out:
        extra = out.pop("unevaluatedProperties")
        out.setdefault("additionalProperties", extra)
    if "unevaluatedItems" in out:
        extra = out.pop("unevaluatedItems")
        if not isinstance(out.get("items"), list):
            out.setdefault("items", extra)
    return out


def _tuple_form(schema: dict[str, Any]) -> tuple[list[Any], Any]:
    """(prefixItems, items) in 2020-12 terms, also for draft 4's `items: [...]`."""
    if isinstance(schema.get("items"), list):
        return list(schema["items"]), schema.get("additionalItems", True)
    return list(schema.get("prefixItems", [])), schema.get("items", True)


def _merge_arrays(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], where: str) -> None:
    """Element i must satisfy both sides' schema for position i (their prefixItems entry, or
    else their items), and later elements both sides' items."""
    pa, ia = _tuple_form(a)
    pb, ib = _tuple_form(b)
    n = max(len(pa), len(pb))
    prefix = [
        {"allOf": [pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib]} for i in range(n)
    ]
    for key in ("prefixItems", "items", "additionalItems"):
        out.pop(key, None)
    if prefix:
        out["prefixItems"] = prefix
    out["items"] = merge_schemas(ia, ib, where=f"{where}/items")


def merge_schemas(a: Any, b: Any, *, where: str, parent: bool = False) -> Any:
    """The intersection of schemas a and b (raw JSON; `True`/`False` allowed, no top-level
    `$ref`: resolve it first). `where` names the location for error messages. parent: a is
    the schema that holds b as an applicator (its allOf branches merged, its $ref target)."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise GrammarError(f"{where}: expected schemas (objects or booleans) in allOf")
    if "properties" in a or "properties" in b or "required" in a or "required" in b:
        _check_extra_names(a, b, where, parent)
    for closed, other, may_see in ((a, b, parent), (b, a, False)):
        if closed.get("unevaluatedItems", True) not in (True, {}) and not may_see:
            if {"prefixItems", "items"} & set(other):
                raise GrammarError(
                    f"{where}: allOf/$ref where one schema restricts unevaluatedItems and "
                    f"another declares items is not supported"
                )
    out = dict(a)
    arrays = {"prefixItems", "items", "additionalItems"}
    if arrays & set(a) and arrays & set(b):
        _merge_arrays(a, b, out, where)
    for key, value in b.items():
        if key in arrays and arrays & set(a):
            continue  # merged above
        if key not in out or key in ANNOTATIONS or key not in CONSTRAINTS:
            out.setdefault(key, value)
            continue
        mine = out[key]
        if _same(mine, value):
            continue
        if key == "type":
            out[key] = _merge_types(mine, value)
        elif key == "properties":
            merged = dict(mine)
            for name, sub in value.items():
                merged[name] = {"allOf": [merged[name], sub]} if name in merged else sub
            out[key] = merged
        elif key == "patternProperties":
            merged = dict(mine)
            for pat, sub in value.items():
                merged[pat] = {"allOf": [merged[pat], sub]} if pat in merged else sub
            out[key] = merged
        elif key == "required":
            out[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "dependentRequired":
            out[key] = {k: list(dict.fromkeys([*mine.get(k, []), *value.get(k, [])])) for k in
                        {*mine, *value}}  # fmt: skip
        elif key in _LOWER_BOUNDS:
            out[key] = max(mine, value)
        elif key in _UPPER_BOUNDS:
            out[key] = min(mine, value)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out[key] = _merge_exclusive(mine, value, key, where)
        elif key == "enum":
            out[key] = [v for v in mine if any(_same(v, w) for w in value)]
        elif key == "const":
            out[key] = mine
            out["enum"] = []  # two different constants: nothing satisfies both
        elif key == "uniqueItems":
            out[key] = bool(mine) or bool(value)
        elif key in ("additionalProperties", "propertyNames"):
            out[key] = merge_schemas(mine, value, where=f"{where}/{key}")
        elif key == "allOf":
            out[key] = [*mine, *value]
        elif key == "not":
            out[key] = {"anyOf": [mine, value]}  # not A and not B = not (A or B)
        elif key == "anyOf":
            if len(mine) * len(value) > 16:
                raise GrammarError(f"{where}: allOf of two large anyOf lists is not supported")
            out[key] = [{"allOf": [x, y]} for x in mine for y in value]
        else:
            raise GrammarError(
                f"{where}: allOf combines two different {key!r} values, which quantkit cannot "
                f"intersect"
            )
    return out
