"""Tool calling through `quantkit serve`, with the pinned `openai` client against a real server
in a subprocess: every tool_choice mode, one call only without parallel calls, streamed deltas
that reassemble to the non-streamed calls, a tool result fed back, a named tool that finishes
within its budget (or says "length"), bad input as 400s, and tools combined with speculation,
the prefix cache and batch invariance (on the INT4 checkpoint of the same model: the C decode
step), each alone and all three together.

The model is test_server.py's tiny random Llama, whose chat template ignores `tools`: the tools
reach it as a system message, and whatever its random weights prefer, the grammar makes every
finished call name a declared tool with arguments valid for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from quantkit.grammar.constraints import validate_json  # noqa: E402
from tests.test_server import KEY, Server, _start, _stop, make_chat_model  # noqa: E402

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
ECHO = {"type": "object", "properties": {"word": {"enum": ["yes", "no"]}},
        "required": ["word"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": ADD}},
    {"type": "function", "function": {"name": "echo", "description": "Say.", "parameters": ECHO}},
]
SCHEMAS = {"add": ADD, "echo": ECHO}
ASK = [{"role": "user", "content": "Add 2 and 3."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("tools-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _start(model_dir, tmp_path_factory.mktemp("home"), "--batch-cap", "4", "--api-key", KEY)
    yield s
    _stop(s)


def _valid(calls: list[Any]) -> list[tuple[str, str]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        name, arguments = call.function.name, call.function.arguments
        assert validate_json(arguments, SCHEMAS[name]) is None, (name, arguments)
        out.append((name, arguments))
    return out


def _ask(server: Server, **extra: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model, messages=extra.pop("messages", ASK), tools=TOOLS,
        temperature=extra.pop("temperature", 0), max_tokens=extra.pop("max_tokens", 200),
        **extra,
    )  # fmt: skip


def test_each_tool_choice_mode(server: Server) -> None:
    required = _ask(server, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and _valid(required.message.tool_calls)
    named = _ask(server, tool_choice={"type": "function", "function": {"name": "echo"}})
    calls = _valid(named.choices[0].message.tool_calls)
    assert [n for n, _ in calls] == ["echo"] and named.choices[0].finish_reason == "tool_calls"
    none = _ask(server, tool_choice="none").choices[0]
    assert not none.message.tool_calls and none.message.content is not None
    auto = _ask(server, tool_choice="auto").choices[0]  # text, or calls that validate
    assert auto.message.tool_calls is None or _valid(auto.message.tool_calls)


def test_one_call_without_parallel_calls(server: Server) -> None:
    for seed in range(3):
        answer = _ask(server, tool_choice="required", parallel_tool_calls=False, seed=seed,
                      temperature=1.0).choices[0]  # fmt: skip
        if answer.finish_reason == "tool_calls":
            assert len(_valid(answer.message.tool_calls)) == 1


def _streamed(server: Server, **extra: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    stream = server.client().chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
        stream=True, **extra,
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": ""})
                entry["id"] += part.id or ""
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_deltas_reassemble_to_the_call(server: Server, choice: str) -> None:
    whole = _ask(server, tool_choice=choice).choices[0]
    calls, finish, content = _streamed(server, tool_choice=choice)
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert finish == whole.finish_reason
    assert all(c["id"].startswith("call_") for c in calls.values())
    if not expected:
        assert content == whole.message.content


def test_a_tool_result_fed_back(server: Server) -> None:
    first = _ask(server, tool_choice={"type": "function", "function": {"name": "add"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    answer = _ask(server, messages=history, tool_choice="none").choices[0]
    assert answer.message.content is not None and not answer.message.tool_calls


@pytest.mark.parametrize("budget", [24, 48])
def test_a_named_tool_finishes_or_says_length(server: Server, budget: int) -> None:
    answer = _ask(server, tool_choice={"type": "function", "function": {"name": "add"}},
                  max_tokens=budget, temperature=1.0, seed=3).choices[0]  # fmt: skip
    if answer.finish_reason == "tool_calls":
        assert [n for n, _ in _valid(answer.message.tool_calls)] == ["add"]
    else:  # honest: cut short; a call is reported only with its arguments whole and valid
        assert answer.finish_reason == "length"
        _valid(answer.message.tool_calls or [])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_bad_tool_input_is_400_and_the_server_keeps_serving(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    body = {"model": server.model, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra}
    status, _, reply = server.raw("POST", "/v1/chat/completions", body)
    error = json.loads(reply)["error"]
    assert status == 400 and error["param"] == param, reply
    assert _ask(server, tool_choice="required").choices[0].message.tool_calls


@pytest.fixture(scope="module")
def int4_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model as INT4: batch invariance runs on the C decode step only."""
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(model_dir, scheme=QuantScheme("int4", "auto", False))
    return outcome.save(tmp_path_factory.mktemp("tools-int4") / "int4", source_dir=model_dir)


@pytest.mark.parametrize(
    "flags",
    [["--speculate", "ngram"], ["--prefix-cache-mb", "16"], ["--batch-invariant"],
     ["--batch-invariant", "--speculate", "ngram", "--prefix-cache-mb", "16"]],
    ids=["speculation", "prefix-cache", "batch-invariant", "all-three"],
)  # fmt: skip
def test_tools_with_engine_options(
    model_dir: Path, int4_dir: Path, tmp_path: Path, flags: list[str]
) -> None:
    """Each engine option beside tools: required calls validate, streamed deltas equal the
    whole answer, and an unconstrained request in the same server still works."""
    model = int4_dir if "--batch-invariant" in flags else model_dir
    s = _start(model, tmp_path / "home", "--batch-cap", "4", "--api-key", KEY, *flags)
    try:
        whole = _ask(s, tool_choice="required").choices[0]
        assert whole.finish_reason == "tool_calls" and _valid(whole.message.tool_calls)
        calls, finish, _ = _streamed(s, tool_choice="required")
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        again = _ask(s, tool_choice="required").choices[0]  # a second time: cache hits
        assert [c.function.arguments for c in again.message.tool_calls] == [
            c.function.arguments for c in whole.message.tool_calls
        ]
        plain = s.client().chat.completions.create(model=s.model, messages=ASK, max_tokens=8)
        assert plain.choices[0].message.content is not None
    finally:
        _stop(s)
