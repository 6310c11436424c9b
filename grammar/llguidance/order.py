"""Objects in any key order, for llguidance.

llguidance produces an object's declared properties in declaration order only, so a valid
document with its keys in another order is rejected, and the model can never write one. JSON
Schema does not order keys, so this narrows the language: on JSONSchemaBench (all 5216
schemas) it was the largest cause of valid test instances rejected (most of the 179).

`any_order` rewrites each object it can afford, children first (nested objects too):

- up to `MAX_PROPERTIES` declared properties: the `anyOf` of k! copies of the object, each
  declaring the same properties in another order. Every copy accepts exactly the values the
  original does (the order of the `properties` map carries no meaning), so the union is exact;
  and every order of every subset of the keys is a subsequence of some permutation, so every
  key order is produced.
- more: the optional properties become `patternProperties`, each matching exactly its name
  (same schema for the same keys, same other keys for additionalProperties: exact), which llguidance
  takes in any order after the declared ones. With no required property that is every order.
  Otherwise the required ones stay declared (in every order when 3 or fewer, else in declaration
  order), so they come first; the object as written stays one more anyOf form, so documents in
  declaration order (often sorted by name, required and optional interleaved) stay accepted; what is
  left is noted. llguidance lets a pattern's key repeat, so the rows then refuse a repeated key
  (`distinct_items`). An object whose own patterns may match one of the names (two
  schemas would apply), or that says minProperties, stays ordered; where llguidance finds a name
  overlapping a pattern merged in from elsewhere (allOf, $ref), the whole schema is compiled again
  with larger objects ordered (`patterns=False`).

Bounded, because the grammar grows by the copies:
- permutations of at most `MAX_PROPERTIES` properties (3: 6 copies). Measured on
  JSONSchemaBench (the 225-schema sample, mask best of 5 walks; the 111 schemas with rejected
  valid instances): up to 2 properties 15 us a mask step, compile p90 23 ms, 54/191 accepted;
  3: 16 us, 44 ms, 56/191; 4: 22 us, 104 ms, 67/191. 4 misses the 20 us mask budget;
- at most `BUDGET` characters of JSON added to the whole schema (else the cheaper form, else
  the object as written);
- never where a `$ref` points into the object's properties (the copies move them), nor in a
  schema with a `$ref` that is not a local JSON pointer (its target cannot be checked).
What is left narrower is reported (`Orders`), as the notes the user sees.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any
from urllib.parse import unquote

from quantkit.grammar.llguidance.schema import rewrite_bottom_up, schema_nodes
from quantkit.grammar.narrowing import objects_note, order_note

__all__ = ["BUDGET", "MAX_PROPERTIES", "Orders", "any_order"]

MAX_PROPERTIES = 3
BUDGET = 200_000  # characters of schema JSON the copies may add, per schema

_META = frozenset("\\.+*?()|[]{}^$#&-~")  # escaped in an exact-name pattern

# Keywords that stay on the object node itself rather than in each copy: what other parts of
# the schema address (definitions, ids, anchors) and annotations.
_STAY = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$anchor", "$dynamicAnchor",
                   "$comment", "title", "description", "examples", "default"})  # fmt: skip


def _pointers(schema: Any) -> list[str] | None:
    """Every `$ref` of `schema` as a decoded local pointer ("#/a/b"), or None when one is not."""
    found = [n["$ref"] for n in schema_nodes(schema) if isinstance(n.get("$ref"), str)]
    out = []
    for ref in found:
        if ref != "#" and not ref.startswith("#/"):
            return None
        out.append(unquote(ref).replace("~1", "/").replace("~0", "~"))
    return out


def _exact(name: str) -> str:
    """A pattern that matches exactly `name` (llguidance reads Rust's regex syntax, in which
    every one of these may be escaped)."""
    return "^" + "".join("\\" + c if c in _META else c for c in name) + "$"


def _free_optional(out: dict[str, Any], optional: list[str]) -> dict[str, Any] | None:
    """`out` with its `optional` declared properties as `patternProperties` that each match
    exactly its name: llguidance takes pattern properties in any order, after the ones in
    `properties`. Exact: a key gets the same schema, and additionalProperties the same other
    keys. None when it would not be: a pattern the node has already may match one of the
    names (both schemas would apply; llguidance requires disjoint patterns), or the node says
    propertyNames or unevaluatedProperties, or minProperties (a repeated key, which a row may
    let through rather than end in a dead end, would count twice; `distinct_items`)."""
    if any(k in out for k in ("propertyNames", "unevaluatedProperties", "minProperties")):
        return None
    patterns = out.get("patternProperties", {})
    if not isinstance(patterns, dict):
        return None
    for pattern in patterns:
        try:
            if any(re.search(pattern, name) for name in optional):
                return None
        except re.error:
            return None
    props = out["properties"]
    moved = {_exact(name): props[name] for name in optional}
    if len(moved) < len(optional) or any(p in patterns for p in moved):
        return None
    kept = {name: props[name] for name in props if name not in optional}
    rest = {k: v for k, v in out.items() if k not in ("properties", "patternProperties")}
    return rest | ({"properties": kept} if kept else {}) | {"patternProperties": patterns | moved}


@dataclass
class Orders:
    """Where objects still come in a narrower key order than JSON Schema's (JSON pointers):
    `ordered`, declared properties in declaration order only; `required_first`, in that order
    or the required properties before the optional ones (each group in any order);
    `required_ordered`, in that order or the required properties in declaration order before
    the optional ones (in any order). `freed`: the objects whose optional properties became
    patterns (llguidance lets a pattern's key repeat: the rows refuse a repeated key)."""

    ordered: list[str] = field(default_factory=list)
    required_first: list[str] = field(default_factory=list)
    required_ordered: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        """One note per kind of narrowing found (`narrowing.order_note` for the first)."""
        out = [
            order_note(self.ordered),
            objects_note(self.required_first, "declared properties are produced in declaration "
                         "order, or the required ones first and then the optional ones, each "
                         "in any order (other orders are valid but never generated)"),
            objects_note(self.required_ordered, "declared properties are produced in "
                         "declaration order, or the required ones first in declaration order "
                         "and then the optional ones in any order (other orders are valid but "
                         "never generated)"),
        ]  # fmt: skip
        return [n for n in out if n]


def _orders_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`body` once per order of its declared properties (one copy when it has fewer than 2)."""
    props = body.get("properties", {})
    return [body | {"properties": {n: props[n] for n in order}} for order in permutations(props)]


def any_order(schema: Any, *, patterns: bool = True) -> tuple[Any, Orders]:
    """(`schema` with its objects' keys in any order where it can afford them, and where
    objects are still narrower than that: `Orders`). patterns=False: larger objects keep their
    declared order (their names as patterns overlapped a pattern llguidance merged in from
    elsewhere, through allOf or a $ref: it refuses overlapping patterns)."""
    pointers = _pointers(schema)
    orders = Orders()
    budget = BUDGET

    def affordable(out: dict[str, Any], forms: list[dict[str, Any]]) -> bool:
        """Whether the budget pays for `forms` in place of `out` (and, if so, pays)."""
        nonlocal budget
        cost = sum(len(json.dumps(f)) for f in forms) - len(json.dumps(out))
        if cost > budget:
            return False
        budget -= max(cost, 0)
        return True

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        props = out.get("properties")
        if not isinstance(props, dict) or len(props) < 2:
            return out
        inside = f"{where}/properties/"
        if pointers is None or any(p.startswith(inside) for p in pointers):
            orders.ordered.append(where)
            return out
        stay = {k: v for k, v in out.items() if k in _STAY}
        body = {k: v for k, v in out.items() if k not in _STAY}
        if len(props) <= MAX_PROPERTIES:
            forms = _orders_of(body)
            if not affordable(body, forms):
                orders.ordered.append(where)
                return out
            return stay | {"anyOf": forms}
        required = out.get("required", [])
        optional = [n for n in props if not isinstance(required, list) or n not in required]
        freed = _free_optional(body, optional) if optional and patterns else None
        if freed is None:
            orders.ordered.append(where)
            return out
        kept = freed.get("properties", {})
        # The declaration order stays one of the forms: the documents written in it (often
        # sorted by name, required and optional interleaved) stay accepted.
        if not kept:  # every declared property optional: any order, exactly
            written = stay | freed
        elif len(kept) <= MAX_PROPERTIES and affordable(
            body, permuted := [body, *_orders_of(freed)]
        ):
            orders.required_first.append(where)
            written = stay | {"anyOf": permuted}
        elif affordable(body, [body, freed]):
            orders.required_ordered.append(where)
            written = stay | {"anyOf": [body, freed]}
        else:
            orders.ordered.append(where)
            return out
        orders.freed.append(where)
        return written

    rewritten = rewrite_bottom_up(schema, fix)
    assert rewritten is not None  # the fix never raises _Unsound
    return rewritten[0], orders
