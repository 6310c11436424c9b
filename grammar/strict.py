"""`strict`, as clients mean it: an object may hold only the properties its schema declares.

JSON Schema lets an object hold any property it does not declare (`additionalProperties`
defaults to true), and a grammar built from the schema as written lets the model invent them:
seen with a held-out GlaiveAI schema, `{"blood_pressure":{"systolic":123,"diastolic":123,
"systolic_blood_pressure":{"blood_pressure":{...` nested until the token limit. OpenAI's
structured outputs (`"strict": true`) and xgrammar's strict mode read the schema the other
way: no property that is not declared. `strict_schema` writes that reading into the schema:
every object schema that says nothing about other properties (no `additionalProperties`,
`patternProperties` or `unevaluatedProperties`) gets `"additionalProperties": false`.

Left open, because closing them would refuse what the schema plainly allows: an object node
beside `allOf` or `$ref` (the properties it admits are declared elsewhere, and
`additionalProperties` sees only its own node's), and the members of an `allOf` (each would
refuse the others' properties).
"""

from __future__ import annotations

from typing import Any

__all__ = ["strict_schema"]

# Keywords whose values are data, not schemas: never walked into.
_DATA = frozenset({"enum", "const", "default", "examples", "required"})
# Keywords whose values map names to schemas (a property called "enum" is a schema).
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions",
                    "dependentSchemas"})  # fmt: skip
_OPEN_BY = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _declares_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    return "object" in kinds or "properties" in node


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` whose objects hold only their declared properties (see the module
    docstring); `schema` itself is not changed."""

    def walk(node: Any, *, in_all_of: bool = False) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DATA:
                out[key] = value
            elif key == "allOf" and isinstance(value, list):
                out[key] = [walk(v, in_all_of=True) for v in value]
            elif key in _NAMED and isinstance(value, dict):
                out[key] = {name: walk(v) for name, v in value.items()}
            else:
                out[key] = walk(value)
        closable = not in_all_of and "allOf" not in node and "$ref" not in node
        if closable and _declares_object(node) and not any(k in node for k in _OPEN_BY):
            out["additionalProperties"] = False
        return out

    return walk(schema)
