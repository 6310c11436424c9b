"""`quantkit generate --tools FILE --tool-choice ...` on a tiny random model: the calls it
makes name a declared tool and their arguments validate, whatever the random weights want; and
one clear line for every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantkit.grammar import compiler
from quantkit.grammar.constraints import validate_json
from tests.conftest import run_cli as run
from tests.test_grammar_cli import generate_refuses

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": ADD}},
    {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"word": {"enum": ["yes", "no"]}}, "required": ["word"],
        "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    compiler.clear_memory_cache()


@pytest.fixture()
def roomy_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with a 1024-token context: the tools' description is ~500 tokens."""
    model = tmp_path / "roomy"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return model


@pytest.fixture()
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    return path


@pytest.mark.parametrize("choice", ["add", "required"])
def test_calls_name_a_tool_and_validate(roomy_model: Path, tools_file: Path, capsys,
                                        choice: str) -> None:  # fmt: skip
    code, out, err = run(
        capsys, "generate", str(roomy_model), "--prompt", "Add 2 and 3.", "--tools",
        str(tools_file), "--tool-choice", choice, "--max-new-tokens", "120", "--json",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    calls = summary["tool_calls"]
    assert calls and summary["output_valid"], summary["text"]
    if choice == "add":
        assert [c["name"] for c in calls] == ["add"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert validate_json(call["arguments"], schemas[call["name"]]) is None, call


@pytest.mark.parametrize(
    "files,args,needles",
    [
        ({"t.json": json.dumps(TOOLS)}, ["--tools", "t.json", "--tool-choice", "mul"],
         ["tool_choice: expected a declared tool (add, echo), got 'mul'"]),
        ({"t.json": "[1"}, ["--tools", "t.json"], ["--tools t.json: expected JSON"]),
        ({"t.json": json.dumps([{"type": "function", "function": {"name": "a b"}}])},
         ["--tools", "t.json"], ["tools[0].function.name"]),
        ({"t.json": json.dumps(TOOLS), "s.json": "{}"},
         ["--tools", "t.json", "--schema", "s.json"], ["--tools: expected no --schema"]),
        ({}, ["--tool-choice", "required"], ["expected --tools FILE with it"]),
    ],
    ids=["unknown-tool", "not-json", "bad-name", "with-schema", "choice-without-tools"],
)  # fmt: skip
def test_bad_tool_input_one_line_each(
    tiny_model_dir: Path, tmp_path: Path, capsys, monkeypatch, files, args, needles
) -> None:
    generate_refuses(tiny_model_dir, tmp_path, capsys, monkeypatch, files,
                     ["--prompt", "x", *args], needles)  # fmt: skip
