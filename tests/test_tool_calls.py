"""Tool calls in the grammar layer (`grammar.tool_calls`): declared tools checked, the call
grammar of each format and mode (what it accepts and refuses), the calls read back out of the
text, a named tool that always finishes within its budget, and the prompt that shows the tools
to a template that does not render them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from quantkit.errors import GrammarError
from quantkit.grammar.acceptance import accepts_tokens
from quantkit.grammar.compiler import compile_grammar
from quantkit.grammar.constraints import validate_json
from quantkit.grammar.llguidance.engine import _greedy_encoder
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.tool_calls import (
    FORMATS,
    ToolCall,
    format_for,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    render_call,
    render_tool_prompt,
    tool_call_grammar,
)
from tests.hand_vocab import EOS, vocab_of

PIECES = [*'{}[]":,;_<>/\n abcdefghijklmnopqrstuvwxyz0123456789.-ABCDEFGHIJKLMNOPQRSTUVWXYZ',
          "<tool_call>\n", "\n</tool_call>", "[TOOL_CALLS]", '{"name":"', "zz"]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip

pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab():
    return vocab_of(PIECES)


def _text(calls: list[ToolCall], fmt_name: str) -> str:
    fmt = FORMATS[fmt_name]
    if fmt.array:
        objects = [f'{{"name":"{c.name}","{fmt.args}":{c.arguments}}}' for c in calls]
        return f"{fmt.open}[{','.join(objects)}]"
    return fmt.separator.join(render_call(c, fmt).replace(", ", ",").replace(": ", ":")
                              for c in calls)  # fmt: skip


CALLS = [ToolCall("add", '{"a":1,"b":2}'), ToolCall("get_weather", '{"city":"Paris"}')]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_and_mode_accepts_calls_and_refuses_the_rest(vocab, fmt: str) -> None:
    tools = parse_tools([WEATHER, ADD])
    encode = _greedy_encoder(vocab)
    one, two = _text(CALLS[:1], fmt), _text(CALLS, fmt)
    bad_args = one.replace('"b":2', '"b":"x"')
    unknown = one.replace('"add"', '"mul"')
    cases = {  # mode -> (accepted, refused)
        "required": ([one, two], ["Just text.", bad_args, unknown, "Hi " + one]),
        "named": ([one], [two, "Just text.", bad_args, _text(CALLS[1:], fmt)]),
        "auto": (["Just text.", one, two], [bad_args, unknown]),
    }
    if FORMATS[fmt].open:  # text before the opening: only where the format has one
        cases["auto"][0].append("Let me see. " + one)
    for mode, (accepted, refused) in cases.items():
        grammar = tool_call_grammar(tools, mode, FORMATS[fmt], name="add" if mode == "named"
                                    else None)  # fmt: skip
        compiled = compile_grammar(grammar, vocab, timeout_s=10)
        for text in accepted:
            assert accepts_tokens(compiled, encode(text.encode())), (mode, text)
        for text in refused:
            assert not accepts_tokens(compiled, encode(text.encode())), (mode, text)
    content, calls = parse_tool_calls(two, FORMATS[fmt])
    assert content is None and calls == CALLS


def test_one_call_only_without_parallel_calls(vocab) -> None:
    tools = parse_tools([WEATHER, ADD])
    grammar = tool_call_grammar(tools, "required", FORMATS["hermes"], parallel=False)
    compiled = compile_grammar(grammar, vocab, timeout_s=10)
    encode = _greedy_encoder(vocab)
    assert accepts_tokens(compiled, encode(_text(CALLS[:1], "hermes").encode()))
    assert not accepts_tokens(compiled, encode(_text(CALLS, "hermes").encode()))


def test_parse_reads_content_and_skips_a_call_cut_short() -> None:
    fmt = FORMATS["hermes"]
    text = 'Sure. <tool_call>\n{"name":"add","arguments":{"a": 1,"b":2}}\n</tool_call>'
    content, calls = parse_tool_calls(text, fmt)
    assert content == "Sure." and calls == [ToolCall("add", '{"a": 1,"b":2}')]  # as written
    assert parse_tool_calls(text[:-25], fmt) == ("Sure.", [])
    assert parse_tool_calls("No call here.", fmt) == ("No call here.", [])
    mistral = FORMATS["mistral"]
    assert parse_tool_calls('[TOOL_CALLS][{"name":"add","arguments":{"a":1', mistral)[1] == []


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([{"type": "code"}], r"tools\[0\]: expected \{\"type\": \"function\""),
        ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name"),
        ([WEATHER, WEATHER], "expected unique names, got 'get_weather' twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
         r"tools\[0\].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}],
         "expected a JSON schema object, got list"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_in_one_line(raw: list[Any], match: str) -> None:
    with pytest.raises(GrammarError, match=match):
        parse_tools(raw)


def test_tool_choice() -> None:
    tools = parse_tools([WEATHER, ADD])
    assert parse_tool_choice(None, tools) == ("auto", None)
    assert parse_tool_choice(None, []) == ("none", None)
    assert parse_tool_choice("required", tools) == ("required", None)
    named = {"type": "function", "function": {"name": "add"}}
    assert parse_tool_choice(named, tools) == ("named", "add")
    with pytest.raises(GrammarError, match=r"tool_choice: expected a declared tool .*got 'mul'"):
        parse_tool_choice({"type": "function", "function": {"name": "mul"}}, tools)
    with pytest.raises(GrammarError, match="expected tools with tool_choice 'required'"):
        parse_tool_choice("required", [])
    with pytest.raises(GrammarError, match="tool_choice: expected"):
        parse_tool_choice("always", tools)


@pytest.mark.parametrize("budget", [80, 120])
def test_a_named_tool_always_finishes_within_its_budget(vocab, budget: int) -> None:
    """A 'model' that would write the city's name forever: the budget closes the call."""
    tools = parse_tools([WEATHER, ADD])
    grammar = tool_call_grammar(tools, "named", FORMATS["hermes"], name="get_weather")
    processor = GrammarLogitsProcessor(compile_grammar(grammar, vocab, timeout_s=10),
                                       max_new_tokens=budget)  # fmt: skip
    scores = torch.zeros(vocab.size)
    for rank, piece in enumerate([*"parisxyzlondon"]):
        scores[PIECES.index(piece) + 1] = 100.0 - rank
    ids, out = torch.zeros((1, 1), dtype=torch.long), []
    for _ in range(budget):
        token = int(processor(ids, scores[None].clone()).argmax())
        if token in EOS:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    else:
        raise AssertionError("no EOS within the budget")
    text = b"".join(vocab.token_bytes[t] for t in out).decode()
    _, calls = parse_tool_calls(text, FORMATS["hermes"])
    assert [c.name for c in calls] == ["get_weather"], text
    schema = WEATHER["function"]["parameters"]
    assert validate_json(calls[0].arguments, schema) is None, text


class _Tokenizer:
    """A chat template in Python: ChatML, rendering `tools` only when `aware`."""

    def __init__(self, aware: bool) -> None:
        self.aware = aware
        self.seen: list[Any] = []

    def apply_chat_template(self, messages, *, add_generation_prompt, tokenize, tools=None):
        self.seen.append(messages)
        head = f"<tools>{json.dumps(tools)}</tools>\n" if tools and self.aware else ""
        body = "".join(f"<|{m['role']}|>{m['content']}{m.get('tool_calls', '')}\n"
                       for m in messages)  # fmt: skip
        return head + body + ("<|assistant|>" if add_generation_prompt else "")


def test_the_prompt_shows_the_tools_whether_or_not_the_template_renders_them() -> None:
    tools = parse_tools([WEATHER])
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [CALLS[1]]},
               {"role": "tool", "content": "sunny"}]  # fmt: skip
    plain = render_tool_prompt(_Tokenizer(aware=False), history, tools, FORMATS["hermes"])
    assert plain.startswith("<|system|>You may call the functions below.")
    assert '"get_weather"' in plain and "<tool_call>" in plain  # the call fed back as text
    assert "<|tool|>sunny" in plain
    aware = _Tokenizer(aware=True)
    rendered = render_tool_prompt(aware, history, tools, FORMATS["hermes"])
    assert rendered.startswith("<tools>") and "<|system|>" not in rendered
    last = aware.seen[-1][1]["tool_calls"]  # the transformers convention: parsed arguments
    assert last == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]


def test_format_from_the_template() -> None:
    assert format_for("{{ '<tool_call>' }}").name == "hermes"
    assert format_for("[TOOL_CALLS] {{ x }}").name == "mistral"
    assert format_for("<|python_tag|>").name == "llama3_json"
    assert format_for(None).name == "hermes"


def test_a_call_made_a_second_time_word_for_word_ends_the_answer(vocab) -> None:
    """A 'model' that would write the same call three times: after the second, only EOS."""
    tools = parse_tools([WEATHER, ADD])
    grammar = tool_call_grammar(tools, "required", FORMATS["hermes"])
    processor = GrammarLogitsProcessor(compile_grammar(grammar, vocab, timeout_s=10))
    call = _text(CALLS[:1], "hermes")
    want = "\n".join([call] * 3).encode()
    ids, written = torch.zeros((1, 1), dtype=torch.long), b""
    for _ in range(400):
        masked = processor(ids, torch.zeros(1, vocab.size))
        allowed = [t for t in range(vocab.size) if torch.isfinite(masked[0, t])]
        going = [t for t in allowed if t not in EOS and want[len(written):].startswith(
            vocab.token_bytes[t])]  # fmt: skip
        if not going:
            break
        token = max(going, key=lambda t: len(vocab.token_bytes[t]))
        written += vocab.token_bytes[token]
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    assert written == "\n".join([call] * 2).encode(), written  # the third never began
    assert allowed == list(EOS)  # only the end is left
