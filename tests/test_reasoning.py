"""Reasoning models (`grammar.reasoning`): on a tiny random Qwen3 whose chat template opens
`<think>`, `quantkit generate --schema` thinks first, within --reasoning-budget, and then
writes JSON valid for the schema; the thinking is reported apart. And the split itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.grammar import compiler
from quantkit.grammar.constraints import validate_json
from quantkit.grammar.reasoning import ReasoningFormat, reasoning_for, split_reasoning
from tests.conftest import make_tokenizer
from tests.conftest import run_cli as run
from tests.family_models import make_family_model

# Qwen3's way: the generation prompt opens the thinking; the template names both markers.
TEMPLATE = (
    "{# reasoning between <think> and </think> #}{% for m in messages %}<|im_start|>"
    "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    compiler.clear_memory_cache()


@pytest.fixture(scope="module")
def qwen3_thinking(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_family_model("qwen3", tmp_path_factory.mktemp("qwen3-think"))
    make_tokenizer(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


@pytest.mark.parametrize("budget", [0, 12, 40])
def test_thinking_then_valid_json_within_the_budget(
    qwen3_thinking: Path, tmp_path: Path, capsys, budget: int
) -> None:
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    code, out, err = run(
        capsys, "generate", str(qwen3_thinking), "--schema", str(tmp_path / "s.json"),
        "--prompt", "Is it on?", "--max-new-tokens", "160", "--reasoning-budget", str(budget),
        "--json",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    assert validate_json(summary["text"], SCHEMA) is None, summary["text"]
    assert summary["output_valid"] and summary["reasoning"] is not None
    assert summary["reasoning_tokens"] <= budget, summary  # random weights never close it
    assert "</think>" not in summary["text"] and "{" not in summary["reasoning"][:1]


def test_split_and_detection() -> None:
    fmt = ReasoningFormat()
    assert split_reasoning("<think>\nhmm\n</think>\n\n{}", fmt) == ("hmm", "{}")
    assert split_reasoning("hmm</think>{}", fmt) == ("hmm", "{}")  # opened by the prompt
    assert split_reasoning("{}", fmt) == (None, "{}")
    assert split_reasoning("<think>cut sh", fmt) == ("cut sh", "")
    assert reasoning_for(TEMPLATE) == fmt and reasoning_for("{{ messages }}") is None


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def thinking_server(qwen3_thinking: Path, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("openai")
    from tests.test_server import KEY, _start, _stop

    s = _start(qwen3_thinking, tmp_path_factory.mktemp("home"), "--api-key", KEY)
    yield s
    _stop(s)


def test_reasoning_content_apart_and_the_schema_after_it(thinking_server) -> None:
    s = thinking_server
    fmt = {"type": "json_schema", "json_schema": {"name": "switch", "schema": SCHEMA}}
    ask = [{"role": "user", "content": "Is it on?"}]
    for budget in (0, 10):
        extra = {"response_format": fmt, "reasoning_budget": budget}
        answer = (
            s.client()
            .chat.completions.create(
                model=s.model, messages=ask, max_tokens=120, temperature=0, extra_body=extra
            )
            .choices[0]
        )
        message = answer.message.model_dump()
        assert validate_json(message["content"], SCHEMA) is None, message
        assert message["reasoning_content"] is not None and "</think>" not in message["content"]
        stream = s.client().chat.completions.create(
            model=s.model, messages=ask, max_tokens=120, temperature=0, extra_body=extra,
            stream=True,
        )  # fmt: skip
        thought, content = "", ""
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                thought += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
        assert content == message["content"]
        assert thought.strip() == message["reasoning_content"]


def test_tools_after_the_thinking(thinking_server) -> None:
    """Tools with reasoning (vLLM #14429's combination): the call comes after the thinking,
    streamed or not, and validates."""
    s = thinking_server
    tools = [{"type": "function", "function": {"name": "set", "parameters": SCHEMA}}]
    ask = [{"role": "user", "content": "Turn it on."}]
    extra = {"reasoning_budget": 6}
    answer = s.client().chat.completions.create(
        model=s.model, messages=ask, tools=tools, tool_choice="required", max_tokens=160,
        temperature=0, extra_body=extra,
    ).choices[0]  # fmt: skip
    message = answer.message.model_dump()
    assert answer.finish_reason == "tool_calls" and message["reasoning_content"] is not None
    calls = message["tool_calls"]
    assert calls and validate_json(calls[0]["function"]["arguments"], SCHEMA) is None
    stream = s.client().chat.completions.create(
        model=s.model, messages=ask, tools=tools, tool_choice="required", max_tokens=160,
        temperature=0, extra_body=extra, stream=True,
    )  # fmt: skip
    arguments, thought = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            thought += delta.get("reasoning_content") or ""
            for part in delta.get("tool_calls") or []:
                arguments += part["function"]["arguments"] or ""
    assert arguments == calls[0]["function"]["arguments"]
    assert thought.strip() == message["reasoning_content"]
