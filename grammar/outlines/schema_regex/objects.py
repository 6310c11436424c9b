"""Lowering of `object` and `array` schemas (see `json_schema` for the whole scheme).

Objects come in two shapes for outlines-core. *Declared*: `properties`/`required` name the keys,
each produced at most once in declaration order, optional ones possibly left out; nothing else is
ever produced, which makes `additionalProperties`, `unevaluatedProperties` and `patternProperties`
(for undeclared names) hold by construction. *Generic*: no names are declared, so keys are any
strings and values follow `additionalProperties`.

Arrays are either a tuple (`prefixItems`, or draft 4's `items: [...]`), produced with exactly as
many elements as the bounds allow, or a list of `items`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.outlines.schema_regex.lowerer import Lowerer
from quantkit.grammar.outlines.schema_regex.merge import merge_schemas
from quantkit.grammar.outlines.schema_regex.regex_parts import object_regex

__all__ = ["COUNT_CAP", "NEVER", "lower_array", "lower_object"]

# A subschema no value satisfies (false, an empty enum, a recursion cut at its depth limit).
NEVER: Any = object()
# Most entries an array or a generic object gets beyond its minimum: `{0,n}` of a complex item
# grows the index roughly n-fold, and outputs past a few items are rarely what a user wants.
COUNT_CAP = 4
# Keywords about property names that free (undeclared) keys could violate.
_NAME_KEYWORDS = ("propertyNames", "dependentRequired", "dependencies", "dependentSchemas")


def _cap(low: int, high: int | None, cap: int) -> int:
    return max(low, cap) if high is None else min(high, max(low, cap))


def counts(node: dict[str, Any], low_key: str, high_key: str) -> tuple[int, int | None]:
    """(minimum, maximum) of a count keyword pair as integers: JSON Schema allows 2.0, and
    outlines-core silently ignores a count that is not an integer."""
    low, high = node.get(low_key, 0), node.get(high_key)
    return math.ceil(low), None if high is None else math.floor(high)


def _dependencies(node: dict[str, Any], where: str) -> dict[str, list[str]]:
    """dependentRequired, plus draft-7 `dependencies` of the array form."""
    out = {k: list(v) for k, v in node.get("dependentRequired", {}).items()}
    for key, value in node.get("dependencies", {}).items():
        if isinstance(value, list):
            out.setdefault(key, []).extend(value)
        elif value not in (True, {}):
            raise GrammarError(
                f"{where}: keyword 'dependencies' with a schema ({key!r}): conditional schemas "
                f"are not supported"
            )
    return out


def _name_allowed(lowerer: Lowerer, node: dict[str, Any], name: str) -> bool:
    names = node.get("propertyNames")
    return names is None or lowerer.validator.evolve(schema=names).is_valid(name)


def lower_object(lowerer: Lowerer, node: dict[str, Any], where: str, refs: tuple) -> Any:
    props = node.get("properties", {})
    required = list(dict.fromkeys(node.get("required", [])))
    extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
    patterns = node.get("patternProperties", {})
    low, high = counts(node, "minProperties", "maxProperties")
    if not props and not required:
        return _generic_object(lowerer, node, where, refs, extra, patterns, low, high)

    # The schema each producible name must satisfy: its own, and every matching pattern's.
    schemas: dict[str, Any] = {}
    for name in [*props, *(r for r in required if r not in props)]:
        schema = props[name] if name in props else (extra if extra is not False else False)
        for pattern, sub in patterns.items():
            if re.search(pattern, name):
                schema = merge_schemas(schema, sub, where=f"{where}/patternProperties")
        if not _name_allowed(lowerer, node, name):
            schema = False
        schemas[name] = schema
    deps = _dependencies(node, where)
    for name in node.get("dependentSchemas", {}):
        if name in schemas:
            raise GrammarError(
                f"{where}: keyword 'dependentSchemas' ({name!r}): conditional schemas are not "
                f"supported"
            )
    # dependentRequired: making the dependencies required is sound (and simple); a name whose
    # dependencies cannot be produced must itself be left out.
    changed = True
    while changed:
        changed = False
        for name, needs in deps.items():
            if name not in schemas or (name not in required and not needs):
                continue
            if any(n not in schemas for n in needs):
                if name in required:
                    return NEVER
                del schemas[name]
                changed = True
                continue
            new = [n for n in needs if n not in required]
            if new:
                required += new
                changed = True

    lowered: dict[str, Any] = {}
    for name, schema in schemas.items():
        sub = lowerer.lower(schema, f"{where}/properties/{name}", refs)
        if sub is NEVER:
            if name in required:
                return NEVER
            continue
        lowered[name] = sub
    optional = [n for n in lowered if n not in required]
    if len(required) < low:  # minProperties: promote optional names, in order
        promote = optional[: low - len(required)]
        if len(required) + len(promote) < low:
            return NEVER
        required += promote
        optional = [n for n in optional if n not in promote]
        lowerer.note(where, f"minProperties {low}: properties {promote} made required")
    if high is not None:
        if len(required) > high:
            return NEVER
        if len(required) + len(optional) > high:
            dropped = optional[high - len(required) :]
            lowered = {n: s for n, s in lowered.items() if n not in dropped}
            lowerer.note(where, f"maxProperties {high}: optional properties {dropped} left out")
    if extra is not False or patterns:
        lowerer.note(where, "properties the schema does not declare are never produced")
    if not lowered:
        return {"type": "object", "maxProperties": 0}
    return {"type": "object", "properties": lowered, "required": [n for n in lowered if n in
            required]}  # fmt: skip


def _generic_object(
    lowerer: Lowerer,
    node: dict[str, Any],
    where: str,
    refs: tuple,
    extra: Any,
    patterns: dict[str, Any],
    low: int,
    high: int | None,
) -> Any:
    empty = {"type": "object", "maxProperties": 0}
    judged = [k for k in _NAME_KEYWORDS if node.get(k, {}) not in ({}, True)]
    judged += ["patternProperties"] if patterns else []
    if judged:
        # Free keys could match a pattern, break propertyNames or trigger a dependency; only {}
        # is surely valid.
        if low > 0:
            raise GrammarError(
                f"{where}: keyword {judged[0]!r} on an object without declared properties is "
                f"not supported"
            )
        lowerer.note(where, f"{judged[0]} without declared properties: only {{}} produced")
        return empty
    if extra is True:
        value = lowerer.any_value()
    else:
        value = lowerer.lower(extra, f"{where}/additionalProperties", refs)
    if value is NEVER or high == 0:
        return empty if low == 0 else NEVER
    top = _cap(low, high, COUNT_CAP)
    if high is None or top < high:
        lowerer.note(where, f"objects without declared properties hold at most {top} entries")
    regex = object_regex(
        lowerer.structure_regex(value), whitespace=lowerer.whitespace, low=low, high=top
    )
    return lowerer.leaf(regex)


def lower_array(lowerer: Lowerer, node: dict[str, Any], where: str, refs: tuple) -> Any:
    low, high = counts(node, "minItems", "maxItems")
    items = node.get("items", node.get("unevaluatedItems", True))
    prefix = node.get("prefixItems")
    if isinstance(items, list):  # draft 4-7 tuple form
        prefix, items = items, node.get("additionalItems", True)
    if node.get("uniqueItems") is True:
        if low > 1 and not prefix:
            raise GrammarError(
                f"{where}: keyword 'uniqueItems' with minItems > 1 is not supported (only "
                f"arrays of at most one item are produced, which are always unique)"
            )
        if high is None or high > 1:
            lowerer.note(where, "uniqueItems: at most one item produced")
        high = 1 if high is None else min(high, 1)
    if high is not None and low > high:
        return NEVER
    if prefix:
        # A tuple: as many elements as the bounds allow around the prefix length; elements past
        # the prefix (only when minItems asks for them) follow `items`.
        count = max(low, len(prefix) if high is None else min(len(prefix), high))
        if node.get("uniqueItems") is True and count > 1:
            raise GrammarError(f"{where}: keyword 'uniqueItems' on a tuple is not supported")
        schemas = [*prefix[:count], *[items] * (count - len(prefix))]
        elements = []
        for i, schema in enumerate(schemas):
            sub = lowerer.lower(schema, f"{where}/prefixItems/{i}", refs)
            if sub is NEVER:
                return NEVER
            elements.append(sub)
        return {"prefixItems": elements} if elements else {"type": "array", "maxItems": 0}
    value = lowerer.any_value() if items is True else lowerer.lower(items, f"{where}/items", refs)
    if value is NEVER or high == 0:
        return {"type": "array", "maxItems": 0} if low == 0 else NEVER
    top = _cap(low, high, COUNT_CAP)
    if high is None or top < high:
        lowerer.note(where, f"arrays hold at most {top} items")
    out: dict[str, Any] = {"type": "array", "items": value, "maxItems": top}
    if low:
        out["minItems"] = low
    return out
