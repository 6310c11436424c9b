"""Tool calling over /v1/chat/completions, as OpenAI's API carries it: `tools`, `tool_choice`
(none, auto, required, a named function), `parallel_tool_calls`; the answer's calls in
`message.tool_calls` (ids, names, JSON-string arguments) with `finish_reason: "tool_calls"`,
or streamed as `delta.tool_calls`; `tool` turns and assistant `tool_calls` accepted back.

The grammar layer does the work (`quantkit.grammar.tool_calls`): the tools shown through the
model's chat template (or a system message when the template ignores them), the call format of
the template's family, the constraint (required and named calls from the first token; auto:
free text until the format's opening, then a well-formed call), and the calls read back. What
this module adds is the HTTP side: the request checked into a `ToolPlan` (bad tools and
unknown names are 400s naming the parameter), and the answer shaped.

Streaming: the text before the first call streams as content, holding back only what could be
the start of the opening; each call streams as one `delta.tool_calls` entry (index, id, type,
name and its whole arguments) as soon as it is complete, which clients accumulate exactly as
they accumulate argument fragments. A call cut short by max_tokens is never sent (the
finish reason then says "length").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.tool_calls import (
    ToolCall,
    ToolFormat,
    ToolSpec,
    format_for,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    render_tool_prompt,
    tool_call_grammar,
)
from quantkit.http_api.protocol import ChatCompletionRequest, ServerError

__all__ = ["ToolPlan", "ToolStream", "tool_message", "tool_plan", "tool_prompt"]


@dataclass(frozen=True)
class ToolPlan:
    tools: list[ToolSpec]
    mode: str  # "none", "auto", "required" or "named"
    name: str | None
    parallel: bool
    fmt: ToolFormat

    def grammar(self) -> Grammar | None:
        if self.mode == "none":
            return None
        return tool_call_grammar(self.tools, self.mode, self.fmt, name=self.name,
                                 parallel=self.parallel)  # fmt: skip


def tool_plan(body: ChatCompletionRequest, tokenizer: Any) -> ToolPlan | None:
    """The request's tools and choice, checked (None without tools); a 400 naming `tools` or
    `tool_choice` for what is wrong."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise ServerError(f"tool_choice: expected tools with it, got {body.tool_choice!r}",
                              param="tool_choice")  # fmt: skip
        return None
    try:
        tools = parse_tools(body.tools)
    except GrammarError as e:
        raise ServerError(str(e), param="tools") from None
    try:
        mode, name = parse_tool_choice(body.tool_choice, tools)
    except GrammarError as e:
        raise ServerError(str(e), param="tool_choice") from None
    fmt = format_for(getattr(tokenizer, "chat_template", None))
    return ToolPlan(tools, mode, name, body.parallel_tool_calls, fmt)


def tool_prompt(body: ChatCompletionRequest, tokenizer: Any, plan: ToolPlan | None) -> str:
    """The conversation through the chat template with the tools shown (none for tool choice
    none), assistant calls and tool results rendered as the template expects."""
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [ToolCall(c.function.name, c.function.arguments)
                                     for c in m.tool_calls]  # fmt: skip
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    shown = plan.tools if plan is not None and plan.mode != "none" else []
    fmt = plan.fmt if plan is not None else format_for(getattr(tokenizer, "chat_template", None))
    return render_tool_prompt(tokenizer, messages, shown, fmt)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _wire(call: ToolCall, call_id: str) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call_id, "type": "function", "function": function}


def tool_message(
    text: str, plan: ToolPlan, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of a finished answer: its calls in
    `tool_calls` and "tool_calls" as the reason when there are any (and it ended normally)."""
    content, calls = parse_tool_calls(text, plan.fmt) if plan.mode != "none" else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        message["content"] = text
        return message, finish_reason
    message["tool_calls"] = [_wire(c, _call_id()) for c in calls]
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass
class ToolStream:
    """One streamed choice's text so far, and what of it has been sent."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    sent_calls: int = 0
    ids: list[str] = field(default_factory=list)

    def feed(self, piece: str, *, final: bool) -> dict[str, Any]:
        """The delta for `piece` (the content not yet sent that is safe to send, the calls
        completed since the last delta); `final`: the answer has ended."""
        self.text += piece
        opening = self.plan.fmt.open
        delta: dict[str, Any] = {}
        if opening:
            at = self.text.find(opening)
            safe = at if at >= 0 else len(self.text) if final else max(
                self.sent_content, len(self.text) - len(opening) + 1)  # fmt: skip
            safe = max(safe, self.sent_content)
        else:  # llama3_json: a call is the whole answer, from its first "{"
            calls_start = self.text.lstrip().startswith("{")
            safe = self.sent_content if calls_start else len(self.text)
        if safe > self.sent_content:
            delta["content"] = self.text[self.sent_content : safe]
            self.sent_content = safe
        _, calls = parse_tool_calls(self.text, self.plan.fmt)
        if len(calls) > self.sent_calls:
            entries = []
            for i in range(self.sent_calls, len(calls)):
                self.ids.append(_call_id())
                entry = _wire(calls[i], self.ids[i])
                entries.append({"index": i, **entry})
            delta["tool_calls"] = entries
            self.sent_calls = len(calls)
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.sent_calls and reason == "stop" else reason
