"""`quantkit generate --schema/--regex/--choice` on a tiny random model: valid outputs, the
summary lines, --output, the cache, and one clear line for every bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from quantkit.grammar import compiler
from quantkit.grammar.constraints import validate_json
from quantkit.grammar.prompting import default_schema_prompt
from tests.conftest import run_cli as run

SMALL = {
    "title": "Switch",
    "description": "A switch setting.",
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    compiler.clear_memory_cache()


def last_line_error(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error:") and "Traceback" not in err, err
    # At most the "compiling ..." progress line comes before the error.
    assert len(lines) == 1 or (len(lines) == 2 and lines[0].startswith("compiling")), err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return lines[-1]


@pytest.fixture()
def small_schema(tmp_path: Path) -> Path:
    path = tmp_path / "switch.json"
    path.write_text(json.dumps(SMALL))
    return path


def test_schema_without_prompt_writes_valid_json(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    # No --prompt: the default one (it must fit the tiny model's 256-token context).
    # Closed (additionalProperties false): a random tiny model would fill an open object with
    # undeclared properties until the token limit, which llguidance (rightly) allows.
    schema = {"title": "Switch", "type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "switch.json").write_text(json.dumps(schema))
    out_file = tmp_path / "answer.json"
    code, out, err = run(
        capsys, "generate", str(tiny_model_dir), "--schema", str(tmp_path / "switch.json"),
        "--max-new-tokens", "64", "--output", str(out_file),
    )  # fmt: skip
    assert code == 0, err
    assert validate_json(out_file.read_text(), schema) is None
    assert json.loads(out_file.read_text()) == json.loads(out.split("\n---\n")[0])
    assert "grammar    schema switch.json: engine llguidance (auto), compiled in" in out
    assert "mask       mean" in out and "of the decode step" in out
    assert "output     JSON, matches the schema" in out
    assert not list(tmp_path.glob(".answer.json.*"))  # no temporary file left behind


def test_json_mode_has_grammar_fields_and_second_run_is_cached(
    tiny_model_dir: Path, small_schema: Path, capsys
) -> None:
    args = ["generate", str(tiny_model_dir), "--schema", str(small_schema), "--json",
            "--max-new-tokens", "64", "--prompt", "Set the switch.",
            "--grammar-engine", "outlines"]  # fmt: skip
    code, out, err = run(capsys, *args)
    assert code == 0, err
    first = json.loads(out)
    assert first["compile_source"] == "compiled" and first["output_valid"] is True
    # No silent narrowing: the bound is in --json and a warning line on stderr.
    assert first["grammar_engine"] == "outlines" and first["engines_refused"] == []
    assert any("declaration order only" in n for n in first["grammar_notes"])
    assert "warning: outlines narrows the schema: #: declared properties" in err
    assert first["mask_mean_us"] > 0 and first["mask_p99_us"] >= first["mask_mean_us"] * 0.5
    assert validate_json(first["text"], SMALL) is None
    compiler.clear_memory_cache()
    code, out, err = run(capsys, *args)
    second = json.loads(out)
    assert code == 0 and second["compile_source"] == "disk" and second["compile_s"] < 1.0


def test_choice_and_regex(tiny_model_dir: Path, capsys) -> None:
    code, out, err = run(
        capsys, "generate", str(tiny_model_dir), "--prompt", "Is it?", "--choice", "yes",
        "--choice", "no", "--choice", "maybe", "--max-new-tokens", "16", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["text"] in ("yes", "no", "maybe")
    code, out, err = run(
        capsys, "generate", str(tiny_model_dir), "--prompt", "A number:", "--regex",
        "[0-9]{3}", "--max-new-tokens", "16", "--json",
    )  # fmt: skip
    assert code == 0, err
    text = json.loads(out)["text"]
    assert len(text) == 3 and text.isdigit()


def test_token_limit_before_the_grammar_is_complete(tiny_model_dir: Path, capsys) -> None:
    code, out, err = run(
        capsys, "generate", str(tiny_model_dir), "--prompt", "x", "--regex", "[a-z]{50}",
        "--max-new-tokens", "3",
    )  # fmt: skip
    last_line_error(code, err, "output incomplete", "raise --max-new-tokens")
    assert "output     incomplete" in out


@pytest.mark.parametrize(
    "files,args,needles",
    [
        ({"s.json": "{not json"}, ["--schema", "s.json"], ["expected a JSON file", "line 1"]),
        ({"s.json": '{"type": 12}'}, ["--schema", "s.json"], ["expected a valid JSON Schema"]),
        ({}, ["--schema", "missing.json"], ["--schema missing.json: cannot read it"]),
        ({}, ["--regex", "(ab"], ["--regex '(ab': expected a valid regex"]),
        ({"s.json": '{"type": "integer", "not": {"multipleOf": 3}}'}, ["--schema", "s.json"],
         ["keyword 'not'"]),
        ({"s.json": "{}"}, ["--schema", "s.json", "--regex", "a"],
         ["--schema and --regex: expected at most one"]),
        ({}, ["--choice", "a", "--choice", "a"], ["expected distinct options"]),
        ({}, ["--regex", "a"], ["--prompt: expected a prompt with regex 'a', got none"]),
        ({"s.json": "{}"}, ["--schema", "s.json", "--compile-timeout", "-1"],
         ["--compile-timeout: expected seconds in (0, 86400]"]),
    ],
    ids=["not-json", "not-a-schema", "missing-file", "bad-regex", "unsupported", "two-constraints",
         "duplicate-choice", "regex-without-prompt", "bad-timeout"],
)  # fmt: skip
def test_bad_input_one_line_each(
    tiny_model_dir: Path, tmp_path: Path, capsys, monkeypatch, files, args, needles
) -> None:
    generate_refuses(tiny_model_dir, tmp_path, capsys, monkeypatch, files, args, needles)


def generate_refuses(
    model: Path, tmp_path: Path, capsys, monkeypatch, files: dict, args: list, needles: list
) -> str:
    """`generate MODEL ARGS` in `tmp_path`, holding `files`, ends in one error line that
    holds every needle (exit 2, no traceback); returns that line."""
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, _, err = run(capsys, "generate", str(model), *args)
    return last_line_error(code, err, *needles)


def test_compile_past_the_limit(tiny_model_dir: Path, capsys) -> None:
    # A bounded repetition of the JSON string body: slow to index (see regex_parts).
    slow = r'"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]){0,40}"'
    code, _, err = run(
        capsys, "generate", str(tiny_model_dir), "--prompt", "x", "--regex", slow,
        "--compile-timeout", "0.5",
    )  # fmt: skip
    last_line_error(code, err, "longer than the limit of 0.5 s (--compile-timeout", "phase")


def test_schema_compile_past_the_limit(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    # Many bounded string properties in objects in an array: seconds to index (measured 4 s).
    item = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 30} for i in range(24)},
    }
    (tmp_path / "slow.json").write_text(json.dumps({"type": "array", "items": item}))
    code, _, err = run(
        capsys, "generate", str(tiny_model_dir), "--schema", str(tmp_path / "slow.json"),
        "--compile-timeout", "0.3", "--grammar-engine", "outlines",
    )  # fmt: skip
    line = last_line_error(code, err, "error: schema slow.json: ", "(--compile-timeout; phase: ")
    # Which phase the 0.3 s run out in depends on the machine's load: the index build (4 s)
    # on a quiet machine, already the lowering (a forked child) on a busy one. Either way the
    # line names the limit and the phase.
    assert re.search(
        r"(compiling the grammar took longer than the limit of 0\.3 s \(--compile-timeout; "
        r"phase: index build\)|lowering the schema used the whole limit \(--compile-timeout; "
        r"phase: lowering\))",
        line,
    ), line


@pytest.fixture()
def embedded_stand_in(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """The tiny model with room for the default prompt plus 128 new tokens (its RoPE is
    computed, so a longer context is a config change), standing in for the embedded model."""
    import shutil

    import quantkit.quantize.embedded

    model = tmp_path / "embedded"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    monkeypatch.setattr(quantkit.quantize.embedded, "ensure_embedded_int4", lambda: model)
    return model


def test_the_users_command_exactly_as_typed(
    embedded_stand_in: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quantkit generate --schema out.json`: no model, no prompt, no other option."""
    import quantkit.cli.generate_cmd as generate_cmd

    prompts: list[str] = []
    real_encode = generate_cmd.encode_prompt

    def encode(tokenizer: Any, prompt: str, **kwargs: Any) -> list[int]:
        prompts.append(prompt)
        return real_encode(tokenizer, prompt, **kwargs)

    monkeypatch.setattr(generate_cmd, "encode_prompt", encode)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.json").write_text(json.dumps(SMALL))
    code, out, err = run(capsys, "generate", "--schema", "out.json")
    assert code == 0, err
    assert prompts == [default_schema_prompt(SMALL)]  # title and description included
    text = out.split("\n---\n")[0]
    assert validate_json(text, SMALL) is None, text
    # The summary names the engine auto picked.
    assert "grammar    schema out.json: engine llguidance (auto), compiled in" in out
    assert "mask       mean" in out and "of the decode step" in out
    assert "output     JSON, matches the schema" in out
    assert json.loads((tmp_path / "out.json").read_text()) == SMALL  # the schema is untouched


def test_default_prompt_names_the_schema() -> None:
    prompt = default_schema_prompt(SMALL)
    assert "JSON object" in prompt and "Switch" in prompt and "A switch setting." in prompt
    assert '"level"' in prompt
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    assert "(schema abbreviated)" in default_schema_prompt(big)
