"""The shape of the schema lowerer that the per-keyword lowerings (`objects`, `unions`) call back
into. `json_schema` holds the one implementation; the lowerings take this protocol instead of
importing that class, so the modules form no import cycle."""

from __future__ import annotations

from typing import Any, Protocol


class Lowerer(Protocol):
    """A JSON Schema -> outlines-core schema lowering in progress (see `json_schema`)."""

    validator: Any  # the jsonschema validator class of the root schema's draft
    whitespace: str  # the regex of the whitespace allowed between JSON tokens

    def leaf(self, regex: str) -> dict[str, Any]:
        """A placeholder subschema that stands for `regex` in the final pattern."""
        ...

    def any_value(self) -> dict[str, Any]:
        """A placeholder for any JSON value."""
        ...

    def structure_regex(self, lowered: Any) -> str:
        """outlines-core's regex for a lowered subschema (placeholders left in place)."""
        ...

    def note(self, where: str, text: str) -> None:
        """Record what the lowering had to narrow or approximate at `where`."""
        ...

    def flatten(self, node: Any, where: str, refs: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
        """`node` with its `$ref`s and `allOf` merged in, and the refs followed so far."""
        ...

    def lower(self, node: Any, where: str, refs: tuple[str, ...]) -> Any:
        """The lowered form of any subschema."""
        ...

    def types_of(self, node: dict[str, Any], where: str) -> list[str] | None:
        """The JSON types `node` allows, or None for any."""
        ...
