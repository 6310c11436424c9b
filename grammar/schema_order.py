"""Objects in any key order, for llguidance.

llguidance produces an object's declared properties in declaration order only, so a valid
document with its keys in another order is rejected, and the model can never write one. JSON
Schema does not order keys, so this narrows the language: on JSONSchemaBench (all 5216
schemas) it was the largest cause of valid test instances rejected (most of the 179).

`any_order` rewrites an object schema with k declared properties as the `anyOf` of k! copies of
itself, each declaring the same properties in another order. Every copy accepts exactly the
values the original does (only the order of the `properties` map differs, and it carries no
meaning), so the union is exact; and every order of every subset of the keys is a subsequence
of some permutation, so every key order is produced. Applied children first, so nested objects
are unordered too.

Bounded, because the grammar grows by k! copies of the object's property schemas:
- at most `MAX_PROPERTIES` declared properties (3: 6 copies). Measured on JSONSchemaBench
  (the 225-schema sample, mask best of 5 walks; the 111 schemas with rejected valid
  instances): up to 2 properties 15 us a mask step, compile p90 23 ms, 54/191 accepted; 3:
  16 us, 44 ms, 56/191; 4: 22 us, 104 ms, 67/191. 4 misses the 20 us mask budget;
- at most `BUDGET` characters of JSON added to the whole schema;
- never where a `$ref` points into the object's properties (the copies move them), nor in a
  schema with a `$ref` that is not a local JSON pointer (its target cannot be checked).
What is left ordered is reported (`ordered`), as the note the user sees.
"""

from __future__ import annotations

import json
from itertools import permutations
from math import factorial
from typing import Any
from urllib.parse import unquote

from quantkit.grammar.llg_schema import rewrite_bottom_up

__all__ = ["BUDGET", "MAX_PROPERTIES", "any_order"]

MAX_PROPERTIES = 3
BUDGET = 200_000  # characters of schema JSON the copies may add, per schema

# Keywords that stay on the object node itself rather than in each copy: what other parts of
# the schema address (definitions, ids, anchors) and annotations.
_STAY = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$anchor", "$dynamicAnchor",
                   "$comment", "title", "description", "examples", "default"})  # fmt: skip


def _refs(node: Any, found: list[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.append(ref)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):
                _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def _pointers(schema: Any) -> list[str] | None:
    """Every `$ref` of `schema` as a decoded local pointer ("#/a/b"), or None when one is not."""
    found: list[str] = []
    _refs(schema, found)
    out = []
    for ref in found:
        if ref != "#" and not ref.startswith("#/"):
            return None
        out.append(unquote(ref).replace("~1", "/").replace("~0", "~"))
    return out


def any_order(schema: Any) -> tuple[Any, list[str]]:
    """(`schema` with every object it can afford as the anyOf of its property orders, the
    places (JSON pointers) of the objects with two or more properties still ordered)."""
    pointers = _pointers(schema)
    ordered: list[str] = []
    budget = BUDGET

    def fix(out: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
        nonlocal budget
        props = out.get("properties")
        if not isinstance(props, dict) or len(props) < 2:
            return out
        inside = f"{where}/properties/"
        if (
            pointers is None
            or len(props) > MAX_PROPERTIES
            or any(p.startswith(inside) for p in pointers)
        ):
            ordered.append(where)
            return out
        cost = (factorial(len(props)) - 1) * len(json.dumps(props))  # only for those it could copy
        if cost > budget:
            ordered.append(where)
            return out
        budget -= cost
        stay = {k: v for k, v in out.items() if k in _STAY}
        body = {k: v for k, v in out.items() if k not in _STAY and k != "properties"}
        copies = [body | {"properties": {n: props[n] for n in order}} for order in
                  permutations(props)]  # fmt: skip
        return stay | {"anyOf": copies}

    rewritten = rewrite_bottom_up(schema, fix)
    assert rewritten is not None  # the fix never raises _Unsound
    return rewritten[0], ordered
