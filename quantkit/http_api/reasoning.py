"""Reasoning over /v1/chat/completions: for a model whose chat template speaks of `<think>`
(`quantkit.grammar.reasoning`), the thinking comes back as `message.reasoning_content` (and
`delta.reasoning_content` when streamed), apart from `content`; a grammar (response_format,
structured_outputs, tools) applies after it; the request's `reasoning_budget` (an extra body
field) caps the thinking tokens. The markers themselves are in neither field."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.grammar.reasoning import ReasoningFormat

__all__ = ["ReasoningStream"]


@dataclass
class ReasoningStream:
    """One streamed choice's text, split as it comes into what is safe to send as reasoning
    and as content: the answer opens with the opening marker (unless the prompt did), a piece
    that could be the start of the closing marker is held back, and the blank space after it
    is not content."""

    fmt: ReasoningFormat
    prompt_open: bool
    text: str = ""
    sent: int = 0  # characters of `text` accounted for
    answering: bool = False
    fresh: bool = False  # the closing marker has just passed: leading space is not content

    def feed(self, piece: str, *, final: bool) -> tuple[str, str]:
        """(reasoning, content) to send for `piece`; `final`: the answer has ended."""
        self.text += piece
        reasoning = ""
        if not self.answering:
            skip = 0 if self.prompt_open else len(self.fmt.open)
            if len(self.text) < skip and not final:
                return "", ""  # the opening marker is still arriving
            self.sent = max(self.sent, min(skip, len(self.text)))
            close = self.text.find(self.fmt.close, self.sent)
            if close < 0:
                hold = 0 if final else len(self.fmt.close) - 1
                end = max(self.sent, len(self.text) - hold)
                reasoning, self.sent = self.text[self.sent : end], end
                return reasoning, ""
            reasoning = self.text[self.sent : close]
            self.sent, self.answering, self.fresh = close + len(self.fmt.close), True, True
        rest = self.text[self.sent :]
        if self.fresh:
            rest = rest.lstrip()
            if not rest and not final:
                return reasoning, ""
            self.fresh = False
        self.sent = len(self.text)
        return reasoning, rest
