"""Narrowings both engines share, found by reading the schema itself.

Each engine reports its own narrowings (outlines-core's lowering in `SchemaRegex.notes`;
llguidance refuses instead of narrowing), except one they have in common: an object's declared
properties are produced in declaration order only (JSON Schema allows any order; both engines'
grammars fix it, measured: `{"age":3,"name":"B"}` is rejected by both when `name` is declared
first). This module finds where that applies, so it is reported as a warning like the others.
"""

from __future__ import annotations

from typing import Any

__all__ = ["property_order_note"]


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


def property_order_note(schema: Any) -> str | None:
    """One note when some object declares two or more properties, else None."""
    found: list[str] = []
    _ordered_objects(schema, "#", found)
    if not found:
        return None
    more = f" and {len(found) - 1} more objects" if len(found) > 1 else ""
    return (
        f"{found[0]}{more}: declared properties are produced in declaration order only "
        f"(other orders are valid but never generated)"
    )
