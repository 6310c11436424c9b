"""What `quantkit generate --tools FILE --tool-choice ...` needs: the tools read and checked
before the model loads, then (with its tokenizer) the prompt that shows them and the grammar
that makes the answer a well-formed call (`quantkit.grammar.tool_calls`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.cli.grammar_run import GrammarRun
from quantkit.errors import GrammarError
from quantkit.grammar.constraints import read_option_file, validate_json
from quantkit.grammar.tool_calls import (
    ToolFormat,
    ToolSpec,
    format_for,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    render_tool_prompt,
    tool_call_grammar,
    tools_system_prompt,
)

__all__ = ["ToolRequest"]


@dataclass(frozen=True)
class ToolRequest:
    tools: list[ToolSpec]
    mode: str  # "none", "auto", "required" or "named"
    name: str | None
    parallel: bool

    @classmethod
    def from_options(cls, path: str | None, choice: str | None, *,
                     parallel: bool = True) -> ToolRequest | None:  # fmt: skip
        """The request --tools/--tool-choice make (None without --tools): the file read (a
        JSON list of OpenAI tools, or an object holding one under "tools") and checked, the
        choice (none, auto, required, or a tool's name) resolved."""
        if path is None:
            if choice is not None:
                raise GrammarError(f"--tool-choice {choice}: expected --tools FILE with it")
            return None
        text = read_option_file("--tools", Path(path), "UTF-8 JSON text")
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"--tools {path}: expected JSON, got invalid JSON at line "
                               f"{e.lineno} column {e.colno}: {e.msg}") from None  # fmt: skip
        if isinstance(raw, dict) and "tools" in raw:
            raw = raw["tools"]
        if not isinstance(raw, list) or not raw:
            raise GrammarError(f"--tools {path}: expected a non-empty JSON list of tools")
        try:
            tools = parse_tools(raw)
            wanted: Any = choice
            if choice not in (None, "none", "auto", "required"):
                wanted = {"type": "function", "function": {"name": choice}}
            mode, name = parse_tool_choice(wanted, tools)
        except GrammarError as e:
            raise GrammarError(f"--tools {path}: {e}") from None
        return cls(tools, mode, name, parallel)

    def prompt_ids(self, tokenizer: Any, prompt: str, *, chat: bool | None = None) -> list[int]:
        """The prompt as one user turn through the chat template, with the tools shown (none
        for tool choice none). Without a template (or with --no-chat), the tools' description
        and then the prompt, as plain text."""
        shown = [] if self.mode == "none" else self.tools
        if chat is False or not getattr(tokenizer, "chat_template", None):
            described = tools_system_prompt(shown, self.format(tokenizer)) if shown else ""
            text = f"{described}\n\n{prompt}\n" if described else prompt
            return list(tokenizer.encode(text, add_special_tokens=True))
        rendered = render_tool_prompt(tokenizer, [{"role": "user", "content": prompt}], shown,
                                      self.format(tokenizer))  # fmt: skip
        return list(tokenizer.encode(rendered, add_special_tokens=False))

    @staticmethod
    def format(tokenizer: Any) -> ToolFormat:
        return format_for(getattr(tokenizer, "chat_template", None))

    def grammar_run(self, tokenizer: Any, *, compile_timeout: float | None,
                    log: Callable[[str], None]) -> GrammarRun | None:  # fmt: skip
        """The constraint for the answer (None for tool choice none)."""
        if self.mode == "none":
            return None
        fmt = self.format(tokenizer)
        grammar = tool_call_grammar(self.tools, self.mode, fmt, name=self.name,
                                    parallel=self.parallel)  # fmt: skip
        return GrammarRun(
            grammar, compile_timeout=compile_timeout, log=log, engine="llguidance",
            checker=lambda text: self.check(text, fmt),
        )  # fmt: skip

    def check(self, text: str, fmt: ToolFormat) -> str | None:
        """None when every call in `text` names a tool and its arguments validate (and there
        is one at least where the choice requires it); else why not."""
        _, calls = parse_tool_calls(text, fmt)
        if not calls and self.mode != "auto":
            return f"holds no tool call (tool choice {self.mode})"
        by_name = {t.name: t for t in self.tools}
        for call in calls:
            tool = by_name.get(call.name)
            if tool is None:
                return f"calls {call.name!r}, which is not a declared tool"
            problem = validate_json(call.arguments, tool.parameters)
            if problem is not None:
                return f"{call.name}: arguments do not validate: {problem}"
        return None

    def calls(self, tokenizer: Any, text: str) -> list[dict[str, str]]:
        """The calls in `text`, as {"name", "arguments"} (arguments: JSON text)."""
        _, calls = parse_tool_calls(text, self.format(tokenizer))
        return [{"name": c.name, "arguments": c.arguments} for c in calls]
