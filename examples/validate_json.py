"""Check a JSON file against a JSON schema with the `jsonschema` library, then print it.

Used by `make demo` on the output of `quantkit generate --schema examples/person.json`:
an independent check (quantkit's own validation is not involved). Formats such as "email"
are checked too.

Usage: python examples/validate_json.py SCHEMA.json DOCUMENT.json
Exit status 0 if the document is valid, 1 if not (one line saying why), 2 on bad arguments.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python examples/validate_json.py SCHEMA.json DOCUMENT.json", file=sys.stderr)
        return 2
    schema_path, doc_path = Path(argv[0]), Path(argv[1])
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        document = json.loads(doc_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: expected two readable JSON files, got {e}", file=sys.stderr)
        return 2
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        message = f"error: {schema_path}: expected a valid JSON Schema, got {e.message}"
        print(message, file=sys.stderr)
        return 2
    errors = list(validator(schema, format_checker=validator.FORMAT_CHECKER).iter_errors(document))
    print(json.dumps(document, indent=2, ensure_ascii=False))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        print(f"INVALID: {doc_path} against {schema_path} at {where}: {error.message}")
        return 1
    print(f"valid: {doc_path} matches {schema_path} (jsonschema {validator.__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
