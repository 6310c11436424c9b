"""The paired grammar benchmark (`evals.grammar.paired`): a revision's grammar package copied out
of git under its own name beside this checkout's, and one paired run on the embedded model."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from quantkit.errors import EvalError
from quantkit.evals.grammar.paired import BASE_NAME, base_grammar, main

pytestmark = pytest.mark.usefixtures("grammar_home")


def test_a_revisions_grammar_imports_under_its_own_name(tmp_path: Path) -> None:
    import quantkit.grammar.processor as this

    base = base_grammar("HEAD", tmp_path)
    assert base.__name__ == BASE_NAME
    processor = importlib.import_module(f"{BASE_NAME}.processor")
    assert sys.modules[f"{BASE_NAME}.processor"] is processor
    assert processor.GrammarLogitsProcessor is not this.GrammarLogitsProcessor
    written = list((tmp_path / BASE_NAME).rglob("*.py"))
    assert written and not any("quantkit.grammar" in f.read_text() for f in written)
    assert (tmp_path / BASE_NAME / "llguidance" / "engine.py").is_file()


def test_an_unknown_revision_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="--base no-such-revision-xyz: expected a revision"):
        base_grammar("no-such-revision-xyz", tmp_path)
    with pytest.raises(EvalError, match="expected --rounds"):
        main(["--base", "HEAD", "--rounds", "0"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(EvalError, match=r"--schema .*bad.json: expected JSON, got"):
        main(["--base", "HEAD", "--schema", str(bad)])


@pytest.mark.slow
def test_a_paired_run_against_head_gives_the_same_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], session_home: None
) -> None:
    """HEAD against this checkout on the demo's schema: both sides generate, every generation
    the same tokens (the exit code says so), and each side's steps are timed. The real model
    from the shared cache (converting it into a temporary home would take minutes)."""
    schema = Path(__file__).resolve().parents[1] / "examples" / "person.json"
    report = tmp_path / "paired.json"
    code = main(["--base", "HEAD", "--schema", str(schema), "--max-new-tokens", "24",
                 "--model", "smollm2-135m", "--json", str(report)])  # fmt: skip
    data = json.loads(report.read_text())
    assert code == 0 and data["generations_same"] == 1 and not data["generations_different"]
    steps = data["per_step_us"]
    assert steps["base"]["steps"] == steps["this"]["steps"] > 0
    assert "same tokens: 1 of 1 generations" in capsys.readouterr().out
