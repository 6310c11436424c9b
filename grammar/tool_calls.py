"""Tool calls: the tools a request declares, the text a model writes to call them (one format
per model family), the grammar that makes that text well formed, and the parser that reads the
calls back out of it.

A request declares tools as OpenAI does (`{"type": "function", "function": {"name",
"description", "parameters", "strict"}}`) and says how they may be used (`tool_choice`):

- "none": no call; the tools are not even shown to the model;
- "auto": free text, or a call. The grammar lets the text run free until the format's opening
  (a lazy lexeme that ends at the first `<tool_call>`, say), and from there allows only a well
  formed call of a declared tool with arguments valid for its parameters;
- "required": one call at least, constrained from the first token;
- a named function (`{"type": "function", "function": {"name": ...}}`): a call of that tool,
  from the first token.

`parallel_tool_calls` (default true) lets one answer hold several calls.

Formats (`FORMATS`, one entry per family convention; `format_for` picks one from the chat
template's text):

- `hermes` (Qwen2.5/Qwen3, Hermes, and the fallback for templates that say nothing):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- `llama3_json` (Llama 3.1+): the call object alone, `{"name": ..., "parameters": {...}}`,
  several separated by `; `;
- `mistral`: `[TOOL_CALLS]` and one JSON array of `{"name", "arguments"}` objects.

Inside a call the JSON is one `%json` schema of llguidance's Lark (an `anyOf` of one object per
tool: `name` a constant, the arguments the tool's `parameters`, with `strict` read as
`grammar.strict`), so the arguments parse and validate whenever the call is finished; the
budget steering (`llguidance.closing`) closes a call before `max_tokens` where it can.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.outlines.schema_regex.json_schema import check_schema
from quantkit.grammar.strict import strict_schema

__all__ = [
    "FORMATS",
    "ToolCall",
    "ToolFormat",
    "ToolSpec",
    "format_for",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "render_call",
    "render_tool_prompt",
    "tool_call_grammar",
    "tools_system_prompt",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as the chat templates' `tools=` argument takes it."""
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters}  # fmt: skip
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolFormat:
    """name; `open`/`close` around each call (hermes) or `open` once before the calls
    (mistral, which writes them as one JSON array); `args`: the key holding the arguments;
    `separator` between calls."""

    name: str
    open: str
    close: str
    args: str
    separator: str
    array: bool = False


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n"),
    "llama3_json": ToolFormat("llama3_json", "", "", "parameters", "; "),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", ",", array=True),
}


def format_for(chat_template: str | None) -> ToolFormat:
    """The format a chat template writes tool calls in (hermes when it says nothing)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or '"parameters"' in template and "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def _fail(param: str, message: str) -> GrammarError:
    return GrammarError(f"{param}: {message}")


def parse_tools(raw: list[Any]) -> list[ToolSpec]:
    """The declared tools, checked: each a function with a valid name and a JSON schema for
    its parameters, no name twice; GrammarError naming the first that is not."""
    tools: list[ToolSpec] = []
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            got = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise _fail(where, f'expected {{"type": "function", "function": {{...}}}}, got {got!r}')
        fn = item.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _fail(f"{where}.function", 'expected an object with a "name" string')
        name = fn["name"]
        if not _NAME.match(name):
            raise _fail(f"{where}.function.name",
                        f"expected 1-64 letters, digits, _ or -, got {name!r}")  # fmt: skip
        if any(t.name == name for t in tools):
            raise _fail(f"{where}.function.name", f"expected unique names, got {name!r} twice")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            got = type(parameters).__name__
            raise _fail(f"{where}.function.parameters", f"expected a JSON schema object, got {got}")
        try:
            check_schema(parameters)
        except GrammarError as e:
            raise _fail(f"{where}.function.parameters", str(e)) from None
        description = fn.get("description") or ""
        tools.append(ToolSpec(name, str(description), parameters, bool(fn.get("strict"))))
    return tools


def parse_tool_choice(choice: Any, tools: list[ToolSpec]) -> tuple[str, str | None]:
    """(mode, name): mode "none", "auto", "required" or "named" (then the tool's name).
    Default: "auto" with tools, "none" without, as OpenAI."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise _fail("tool_choice", f"expected tools with tool_choice {choice!r}, got none")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(t.name == name for t in tools):
            known = ", ".join(t.name for t in tools) or "none"
            raise _fail("tool_choice", f"expected a declared tool ({known}), got {name!r}")
        return "named", name
    raise _fail("tool_choice", 'expected "none", "auto", "required" or {"type": "function", '
                f'"function": {{"name": ...}}}}, got {choice!r}')  # fmt: skip


def _call_schema(tools: list[ToolSpec], fmt: ToolFormat) -> dict[str, Any]:
    branches = []
    for tool in tools:
        params = strict_schema(tool.parameters) if tool.strict else tool.parameters
        branches.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, fmt.args: params},
            "required": ["name", fmt.args],
            "additionalProperties": False,
        })  # fmt: skip
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    # Compact, as the JSON schemas of `--schema` (llguidance's Lark default is flexible: a
    # model could write whitespace without end).
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _lit(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def tool_call_grammar(tools: list[ToolSpec], mode: str, fmt: ToolFormat, *,
                      name: str | None = None, parallel: bool = True) -> Grammar:  # fmt: skip
    """The Lark grammar (llguidance) for an answer under `mode` ("auto", "required" or
    "named"); see the module docstring."""
    chosen = [t for t in tools if t.name == name] if mode == "named" else tools
    many = parallel and mode != "named"
    # `first` is the first call without its opening (auto's free text consumed it already).
    if fmt.array:  # [TOOL_CALLS][{...},{...}]
        first = '"[" call ("," call)* "]"' if many else '"[" call "]"'
        rules = ""
    elif fmt.open:  # <tool_call>\n{...}\n</tool_call> per call
        first = f"call {_lit(fmt.close)}" + (" more" if many else "")
        rules = f"more: ({_lit(fmt.separator)} {_lit(fmt.open)} call {_lit(fmt.close)})*\n"
    else:  # {...}; {...}
        first = "call" + (f" ({_lit(fmt.separator)} call)*" if many else "")
        rules = ""
    if mode != "auto":
        head = f"start: {_lit(fmt.open)} {first}\n" if fmt.open else f"start: {first}\n"
    elif fmt.open:
        # Free text that never holds the opening, or text up to the first opening (a lazy
        # lexeme ends at its first match) and then the calls.
        trigger = "".join({"\n": r"\n", "\t": r"\t", "/": r"\/"}.get(c) or re.escape(c)
                          for c in fmt.open)  # fmt: skip
        head = ("start: FREE | pre " + first + "\n"
                f"FREE: /(?s:.*)/ & ~/(?s:.*{trigger}.*)/\n"
                f"pre[lazy]: /(?s:.*){trigger}/\n")  # fmt: skip
    else:  # llama3_json: text that does not begin with "{", or the calls
        head = f"start: FREE | {first}\nFREE: /[^{{](?s:.*)/\n"
    call = "call: %json " + json.dumps(_call_schema(chosen, fmt)) + "\n"
    label = f"tool calls ({mode}{': ' + name if name else ''}, {fmt.name})"
    # Constrained from the first token, the text is call syntax and JSON only: its rows check
    # keys and runaways as a JSON document's do (`llguidance.distinct_items`, `runaway`).
    return Grammar("lark", None, label, lark=head + rules + call, json_text=mode != "auto")


_CALL_OBJECT = re.compile(r"\{")


def _calls_in(text: str, fmt: ToolFormat) -> list[ToolCall]:
    """Each call object in `text`, its arguments as the model wrote them."""
    decoder = json.JSONDecoder()
    found: list[ToolCall] = []
    at = 0
    while True:
        match = _CALL_OBJECT.search(text, at)
        if match is None:
            return found
        try:
            value, end = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            return found
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            found.append(ToolCall(value["name"], _arguments_text(text[match.start() : end],
                                                                 value, fmt)))  # fmt: skip
        at = end


def _arguments_text(call: str, value: dict[str, Any], fmt: ToolFormat) -> str:
    """The arguments' JSON text inside `call` (the object's text) as written, when it can be
    found; else the value written compactly."""
    key = f'"{fmt.args}":'
    at = call.find(key)
    if at >= 0:
        try:
            parsed, end = json.JSONDecoder().raw_decode(call, at + len(key))
            if parsed == value.get(fmt.args):
                return call[at + len(key) : end]
        except json.JSONDecodeError:
            pass
    return json.dumps(value.get(fmt.args, {}), ensure_ascii=False, separators=(",", ":"))


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer: the text before the first call (None when
    empty) and each complete call, in order. A call cut short (by max_tokens) is not one."""
    if fmt.open:
        at = text.find(fmt.open)
        if at < 0:
            return (text or None), []
        content, rest = text[:at], text[at + len(fmt.open) :]
    else:
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            return (text or None), []
        content, rest = "", stripped
    if fmt.array:  # one array: only whole when its closing bracket came
        try:
            json.JSONDecoder().raw_decode(rest)
        except json.JSONDecodeError:
            return (content.strip() or None), []
    return (content.strip() or None), _calls_in(rest, fmt)


def render_call(call: ToolCall, fmt: ToolFormat) -> str:
    """The text a model of `fmt` writes for `call` (an assistant turn fed back)."""
    body = json.dumps({"name": call.name, fmt.args: json.loads(call.arguments or "{}")},
                      ensure_ascii=False)  # fmt: skip
    if fmt.array:
        return f"{fmt.open}[{body}]"
    return f"{fmt.open}{body}{fmt.close}"


def tools_system_prompt(tools: list[ToolSpec], fmt: ToolFormat) -> str:
    """The tools described for a chat template that does not render them itself."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    example = render_call(ToolCall("NAME", '{"ARG": "VALUE"}'), fmt)
    return ("You may call the functions below. To call one, write:\n"
            f"{example}\nFunctions:\n{listed}")  # fmt: skip


def _template_messages(messages: list[dict[str, Any]], fmt: ToolFormat, *,
                       aware: bool) -> list[dict[str, Any]]:  # fmt: skip
    """OpenAI messages as chat templates take them: an assistant turn's `tool_calls` with
    their arguments parsed (the transformers convention) for a template that renders tools,
    else written into its content in `fmt`; a `tool` turn's content as text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if calls and aware:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")},
                }
                for c in calls
            ]
        elif calls:
            written = "\n".join(render_call(c, fmt) for c in calls)
            message["content"] = "\n".join(p for p in (message.get("content"), written) if p)
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out


def render_tool_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[ToolSpec],
                       fmt: ToolFormat) -> str:  # fmt: skip
    """The conversation through the tokenizer's chat template with `tools=`, the assistant
    turn opened. A template that ignores `tools` (its text is the same without them) gets
    them described in the system message instead (`tools_system_prompt`), so the model
    always sees what it may call. An assistant turn's calls (ToolCall values under
    "tool_calls") and `tool` turns are rendered as the template expects."""

    def render(msgs: list[dict[str, Any]], **extra: Any) -> str:
        return str(tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                 tokenize=False, **extra))  # fmt: skip

    if not tools:
        return render(_template_messages(messages, fmt, aware=False))
    listed = [t.as_openai() for t in tools]
    plain = _template_messages(messages, fmt, aware=False)
    try:
        aware = render(plain, tools=listed) != render(plain)
    except Exception:  # noqa: BLE001 - a template may refuse the argument in any way
        aware = False
    if aware:
        return render(_template_messages(messages, fmt, aware=True), tools=listed)
    described = tools_system_prompt(tools, fmt)
    if plain and plain[0].get("role") == "system":
        plain = [{**plain[0], "content": f"{plain[0]['content']}\n\n{described}"}, *plain[1:]]
    else:
        plain = [{"role": "system", "content": described}, *plain]
    return render(plain)
