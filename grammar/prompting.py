"""The prompt used when the user gives a schema but no prompt."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["default_schema_prompt"]

# A schema longer than this is cut in the prompt: the grammar enforces all of it anyway, and a
# small model's context (and attention) is better spent on the answer.
_SCHEMA_CHARS = 3000


def default_schema_prompt(schema: Any, *, max_schema_chars: int = _SCHEMA_CHARS) -> str:
    """Ask for a JSON value matching `schema`, naming its title and description; the schema
    itself follows, cut after `max_schema_chars` characters."""
    kind = (
        "JSON object"
        if isinstance(schema, dict) and schema.get("type") == "object"
        else "JSON value"
    )
    if isinstance(schema, dict) and "properties" in schema:
        kind = "JSON object"
    title = schema.get("title") if isinstance(schema, dict) else None
    description = schema.get("description") if isinstance(schema, dict) else None
    lines = [
        f"Write one {kind}" + (f" describing a {title}" if isinstance(title, str) else "") + "."
    ]
    if isinstance(description, str) and description.strip():
        lines.append(f"It is: {description.strip()}")
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > max_schema_chars:
        text = text[:max_schema_chars] + " ... (schema abbreviated)"
    lines.append(f"It must match this JSON schema: {text}")
    lines.append("Fill every field with a realistic value. Answer with the JSON only.")
    return "\n".join(lines)
