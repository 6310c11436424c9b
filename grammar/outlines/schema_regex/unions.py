"""Lowering of `anyOf`, `oneOf` and the simple forms of `not` (see `json_schema`).

`anyOf` is a union: each branch (with the siblings of `anyOf` merged in) is lowered; a branch
that cannot be lowered is dropped (the union of the rest is still sound) unless none is left.

`oneOf` is a union whose outputs must match *exactly one* branch, so it is accepted only where
no output of one branch can satisfy another. For each ordered pair (i, j), one of:

- the JSON types branch i produces and the types branch j accepts are disjoint (a branch without
  `type` accepts every type, whatever quantkit would produce for it);
- branch i is an enum/const whose every value fails branch j (checked with jsonschema);
- both are objects with a required const "tag" property whose values differ;
- branch i only produces objects and branch j requires a property branch i never produces.
  To get there, each branch is narrowed first: it drops its *optional* properties that another
  branch requires, which is sound (a valid object stays valid without an optional property).
"""

from __future__ import annotations

import json
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.outlines.schema_regex.lowerer import Lowerer
from quantkit.grammar.outlines.schema_regex.merge import merge_schemas
from quantkit.grammar.outlines.schema_regex.objects import NEVER

__all__ = ["ALL_TYPES", "FRACTIONAL", "apply_not", "lower_union"]

ALL_TYPES = ("null", "boolean", "object", "array", "number", "string")
# Set on a node whose numbers must not be integers (from `not: {type: integer}`).
FRACTIONAL = "x-quantkit-fractional"
_TYPE_OF = {type(None): "null", bool: "boolean", dict: "object", list: "array", str: "string",
            int: "number", float: "number"}  # fmt: skip


def apply_not(lowerer: Lowerer, node: dict[str, Any], where: str, refs: tuple) -> Any:
    """`node` with its `not` turned into positive keywords, where that is exact or a sound
    narrowing; GrammarError for the rest."""
    negated, _ = lowerer.flatten(node["not"], f"{where}/not", refs)
    rest = {k: v for k, v in node.items() if k != "not"}
    if negated is False or negated is NEVER:
        return rest
    if negated is True or negated == {}:
        return False
    keys = {k for k in negated if k not in ("title", "description", "$comment")}
    if keys == {"not"}:  # not (not A) = A
        return merge_schemas(rest, negated["not"], where=where)
    if "enum" in rest or "const" in rest:
        # The enum values are checked against the whole node, `not` included (lower_enum).
        return node
    if keys == {"type"}:
        banned = {negated["type"]} if isinstance(negated["type"], str) else set(negated["type"])
        if "number" in banned:
            banned.add("integer")
        allowed = lowerer.types_of(rest, where) or list(ALL_TYPES)
        out = {**rest, "type": [t for t in allowed if t not in banned]}
        if "number" in out["type"] and "integer" in banned:
            out[FRACTIONAL] = True  # numbers, but never integers: lower_number writes a fraction
        return out
    if keys == {"required"} and negated["required"]:
        # Not all of these names: leave out one that the node does not require itself.
        required = set(rest.get("required", []))
        free = [n for n in negated["required"] if n not in required]
        if not free:
            return False
        return merge_schemas(rest, {"properties": {free[0]: False}}, where=where)
    raise GrammarError(
        f"{where}: keyword 'not': negation cannot be expressed by a regular grammar (supported: "
        f"not of types, of required names, or next to an enum)"
    )


def lower_union(lowerer: Lowerer, node: dict[str, Any], where: str, refs: tuple) -> Any:
    if "anyOf" in node and "oneOf" in node:
        raise GrammarError(f"{where}: anyOf and oneOf together are not supported")
    key = "anyOf" if "anyOf" in node else "oneOf"
    rest = {k: v for k, v in node.items() if k not in (key, "$defs", "definitions")}
    branches = [merge_schemas(rest, {"allOf": [b]}, where=where) if rest else b for b in node[key]]
    if key == "oneOf":
        branches = _exclusive_branches(lowerer, branches, where, refs)
    options, errors = [], []
    for i, branch in enumerate(branches):
        try:
            sub = lowerer.lower(branch, f"{where}/{key}/{i}", refs)
        except GrammarError as e:
            errors.append(e)
            continue
        if sub is not NEVER:
            options.append(sub)
    if errors and not options:
        raise errors[0]
    for e in errors:  # sound: an output still matches one of the remaining branches
        lowerer.note(where, f"{key} branch dropped ({e})")
    if not options:
        return NEVER
    return options[0] if len(options) == 1 else {"anyOf": options}


def _accepted_types(lowerer: Lowerer, branch: dict[str, Any], where: str) -> set[str]:
    if "const" in branch or "enum" in branch:
        values = [branch["const"]] if "const" in branch else branch["enum"]
        return {_TYPE_OF.get(type(v), "number") for v in values}
    if "type" in branch:
        return {"number" if t == "integer" else t for t in lowerer.types_of(branch, where) or ()}
    return set(ALL_TYPES)


def _produced_types(lowerer: Lowerer, branch: dict[str, Any], where: str) -> set[str]:
    if "const" in branch or "enum" in branch or "type" in branch:
        return _accepted_types(lowerer, branch, where)
    if {"anyOf", "oneOf"} & set(branch):
        return set(ALL_TYPES)
    return {"number" if t == "integer" else t for t in lowerer.types_of(branch, where) or ALL_TYPES}


def _tag(branch: dict[str, Any]) -> dict[str, str]:
    props, required = branch.get("properties", {}), branch.get("required", [])
    return {
        name: json.dumps(sub["const"], sort_keys=True)
        for name, sub in props.items()
        if name in required and isinstance(sub, dict) and "const" in sub
    }


def _producible(branch: dict[str, Any]) -> set[str] | None:
    """Names an object of this branch may hold (None: any, an object without declared names)."""
    props, required = branch.get("properties", {}), branch.get("required", [])
    if not props and not required:
        return None
    return {n for n in [*props, *required] if props.get(n, True) is not False}


def _excludes(lowerer: Lowerer, i: dict[str, Any], j: dict[str, Any], where: str) -> bool:
    """Whether no output of branch i can satisfy branch j."""
    if not _produced_types(lowerer, i, where) & _accepted_types(lowerer, j, where):
        return True
    if "const" in i or "enum" in i:
        check = lowerer.validator.evolve(schema=j)
        return not any(check.is_valid(v) for v in ([i["const"]] if "const" in i else i["enum"]))
    if _produced_types(lowerer, i, where) != {"object"}:
        return False
    tag_i, tag_j = _tag(i), _tag(j)
    if any(name in tag_i and tag_i[name] != value for name, value in tag_j.items()):
        return True
    producible = _producible(i)
    return producible is not None and bool(set(j.get("required", [])) - producible)


def _exclusive_branches(lowerer: Lowerer, branches: list[Any], where: str, refs: tuple) -> list:
    flat = []
    for i, branch in enumerate(branches):
        sub, _ = lowerer.flatten(branch, f"{where}/oneOf/{i}", refs)
        flat.append(sub)
    live = [b if isinstance(b, dict) else {} for b in flat if b is not NEVER and b is not False]
    required = [set(b.get("required", [])) for b in live]
    narrowed = []
    for i, branch in enumerate(live):
        others = set().union(*(r for k, r in enumerate(required) if k != i)) - required[i]
        drop = sorted(n for n in others if n in branch.get("properties", {}))
        if drop:  # `false`: the name must not appear, so this branch never produces it
            branch = {
                **branch,
                "properties": {**branch["properties"], **dict.fromkeys(drop, False)},
            }
        narrowed.append(branch)
    for i, a in enumerate(narrowed):
        for j, b in enumerate(live):
            if i != j and not _excludes(lowerer, a, b, where):
                raise GrammarError(
                    f"{where}: keyword 'oneOf': branches {i} and {j} may both match one value, "
                    f"which quantkit cannot rule out (supported: different types, different "
                    f"constants, a required const tag, or different required properties)"
                )
    return narrowed
