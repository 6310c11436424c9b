"""Grammars beyond JSON Schema through `quantkit serve`: `response_format` of type grammar
(Lark, and GBNF), regex and choice, and vLLM's `structured_outputs` field, with the openai
client against a real server in a subprocess; and each bad input a 400 in OpenAI's shape while
the server keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from quantkit.grammar.cfg import gbnf_to_lark, lark_accepts  # noqa: E402
from quantkit.grammar.constraints import lark_grammar, validate_json  # noqa: E402
from tests.test_server import KEY, Server, _start, _stop  # noqa: E402
from tests.test_server_tools import model_dir  # noqa: E402, F401 - the fixture

SQL = 'start: "SELECT " COLS " FROM " TABLE\nCOLS: COL (", " COL)*\nCOL: "id" | "name" | "age"\n' \
      'TABLE: "users" | "orders"\n'  # fmt: skip
GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]\n'
ASK = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # noqa: F811
    s = _start(model_dir, tmp_path_factory.mktemp("home"), "--batch-cap", "4", "--api-key", KEY)
    yield s
    _stop(s)


def _chat(server: Server, seed: int = 0, **extra: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model, messages=ASK, max_tokens=48, temperature=1.0, seed=seed, **extra
    )


def test_a_lark_grammar_in_response_format(server: Server) -> None:
    for seed in range(5):
        answer = _chat(server, seed, extra_body={"response_format": {"type": "grammar",
                                                                     "grammar": SQL}})  # fmt: skip
        text = answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "stop"
        assert lark_accepts(lark_grammar(SQL), text), text


def test_a_gbnf_grammar_regex_and_choice(server: Server) -> None:
    for seed in range(3):
        gbnf = (
            _chat(
                server,
                seed,
                extra_body={
                    "response_format": {"type": "grammar", "grammar": GBNF, "syntax": "gbnf"}
                },
            )
            .choices[0]
            .message.content
        )
        assert re.fullmatch(r"yes|no|maybe [0-9]", gbnf), gbnf
        regex = (
            _chat(
                server,
                seed,
                extra_body={"response_format": {"type": "regex", "regex": "[a-c]{2,4}-[0-9]"}},
            )
            .choices[0]
            .message.content
        )
        assert re.fullmatch("[a-c]{2,4}-[0-9]", regex), regex
        choice = (
            _chat(
                server,
                seed,
                extra_body={"response_format": {"type": "choice", "choice": ["red", "green"]}},
            )
            .choices[0]
            .message.content
        )
        assert choice in ("red", "green")  # fmt: skip


def test_vllm_structured_outputs(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    cases = [
        ({"json": schema}, lambda t: validate_json(t, schema) is None),
        ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"grammar": SQL}, lambda t: lark_accepts(lark_grammar(SQL), t)),
        ({"grammar": GBNF}, lambda t: lark_accepts(lark_grammar(gbnf_to_lark(GBNF)), t)),
    ]
    for so, ok in cases:  # fmt: skip
        text = _chat(server, extra_body={"structured_outputs": so}).choices[0].message.content
        assert ok(text), (so, text)
    completion = server.client().completions.create(
        model=server.model, prompt="x", max_tokens=8, extra_body={"structured_outputs": {
            "choice": ["alpha", "beta"]}})  # fmt: skip
    assert completion.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"response_format": {"type": "grammar", "grammar": "start: (("}}, "response_format",
         "response_format.grammar"),
        ({"response_format": {"type": "grammar"}}, "response_format", "expected the grammar"),
        ({"response_format": {"type": "grammar", "grammar": 'root ::= <[12]>', "syntax": "gbnf"}},
         "response_format", "token"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "got both"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex"),
        ({"reasoning_budget": 3}, "reasoning_budget", "expected a reasoning model"),
    ],
)  # fmt: skip
def test_bad_grammars_are_400_and_the_server_keeps_serving(
    server: Server, extra: dict[str, Any], param: str, needle: str
) -> None:
    body = {"model": server.model, "messages": ASK, "max_tokens": 4, **extra}
    status, _, reply = server.raw("POST", "/v1/chat/completions", body)
    error = json.loads(reply)["error"]
    assert status == 400 and error["param"] == param and needle in error["message"], reply
    assert _chat(server).choices[0].message.content is not None


def test_a_grammar_too_large_is_bounded_by_the_compile_limit(
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    s = _start(model_dir, tmp_path / "home", "--api-key", KEY, "--compile-timeout", "0.05")
    try:
        rules = "\n".join(f"r{i}: r{i + 1}" for i in range(20000))
        body = {"model": s.model, "messages": ASK, "max_tokens": 4, "response_format": {
            "type": "grammar", "grammar": f'start: r0\n{rules}\nr20000: "end"\n'}}  # fmt: skip
        status, _, reply = s.raw("POST", "/v1/chat/completions", body)
        error = json.loads(reply)["error"]
        assert status == 400 and "took longer than the limit of 0.05 s" in error["message"], reply
        assert _chat(s).choices[0].message.content is not None
    finally:
        _stop(s)
