"""`make demo`'s last step, on the embedded model: a schema-constrained answer that finishes.

That step once ran to the token limit on `main` for a session before anyone saw it (a finishing
walk that went round in an email's local part, 7ae7053): no test ran the real model through a
schema. This runs the demo's schema on the embedded model's own weights (dense: quantizing it
would take minutes) with the demo's prompt and limit, and checks what a user would: exit 0, a
finished document, valid against the schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import run_cli as run

SCHEMA = Path(__file__).resolve().parents[1] / "examples" / "person.json"


@pytest.mark.slow
def test_the_demo_schema_step_finishes_on_the_embedded_model(tmp_path: Path, capsys) -> None:
    from quantkit.sources.resolve import resolve_model

    dense = resolve_model("smollm2-135m", progress=False)  # the GGUF converted, not quantized
    out = tmp_path / "person.json"
    code, stdout, err = run(
        capsys, "generate", str(dense), "--schema", str(SCHEMA), "--output", str(out),
        "--max-new-tokens", "128", "--threads", "1",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    document = json.loads(out.read_text())
    jsonschema.validate(document, json.loads(SCHEMA.read_text()))
    assert "token limit" not in err, err[-2000:]
