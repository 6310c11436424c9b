"""Narrowings found by reading the schema itself.

Each engine reports its own narrowings (outlines-core's lowering in `SchemaRegex.notes`;
llguidance refuses instead of narrowing), except one: an object's declared properties are
produced in declaration order only (JSON Schema allows any order; both engines' grammars fix
it, measured: `{"age":3,"name":"B"}` is rejected when `name` is declared first). For
outlines-core this module finds where that applies, so it is reported as a warning like the
others; llguidance gets objects in any order where it can afford them (`llguidance.order`) and
reports what is left (`llguidance.order.Orders`, this module's note for wholly ordered ones).
"""

from __future__ import annotations

from typing import Any

__all__ = ["objects_note", "order_note", "ordered_objects", "property_order_note"]


def _ordered_objects(node: Any, where: str, found: list[str]) -> None:
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and len(props) >= 2:
            found.append(where)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):  # values, not schemas
                _ordered_objects(value, f"{where}/{key}", found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _ordered_objects(value, f"{where}/{i}", found)


def ordered_objects(schema: Any) -> list[str]:
    """Where (JSON pointers) an object declares two or more properties."""
    found: list[str] = []
    _ordered_objects(schema, "#", found)
    return found


def property_order_note(schema: Any) -> str | None:
    """One note when some object declares two or more properties, else None."""
    return order_note(ordered_objects(schema))


def objects_note(found: list[str], what: str) -> str | None:
    """The note saying `what` of the objects at `found` (naming the first), None if none."""
    if not found:
        return None
    more = f" and {len(found) - 1} more objects" if len(found) > 1 else ""
    return f"{found[0]}{more}: {what}"


def order_note(found: list[str]) -> str | None:
    """The note for objects at `found` whose properties come in declaration order only."""
    return objects_note(
        found,
        "declared properties are produced in declaration order only (other orders are valid "
        "but never generated)",
    )
