"""Reasoning models: free thinking first, then the constrained answer.

A model like Qwen3 writes `<think> ... </think>` before its answer. A grammar applied from the
first token forbids the thinking (a JSON schema allows no `<think>`), and a response that does
not separate the two hands the client the thinking as content. So for a model whose chat
template speaks of `<think>` (`reasoning_for`), `ReasoningGate` wraps the answer's grammar:

- the answer opens with the marker (forced, unless the prompt already ends in it, as templates
  that open the thinking for the model do), then the thinking runs free (but for EOS, when an
  answer is constrained: it must come);
- it ends when the model writes the closing marker, or is made to: once `budget` thinking tokens
  are spent (`--reasoning-budget`), or once only `reserve` tokens of the whole budget are left
  (room for the answer), the closing marker's tokens are forced;
- from the token after it, the grammar (if any) constrains the rest, with its own budget
  steering counted from there.

`split_reasoning` reads an answer back into (reasoning, content). Only the closing marker is
watched: a model that writes it inside a single token with more text after it is not cut
apart (the markers are single tokens in the vocabularies that use them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["ReasoningFormat", "ReasoningGate", "reasoning_for", "split_reasoning"]


@dataclass(frozen=True)
class ReasoningFormat:
    open: str = "<think>"
    close: str = "</think>"


def reasoning_for(chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning markers a chat template speaks of (None: the model does not reason)."""
    fmt = ReasoningFormat()
    return fmt if chat_template and fmt.close in chat_template else None


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """(reasoning, content): the thinking between the markers (the opening may be in the
    prompt) and what follows the closing marker; (None, text) without one."""
    at = text.find(fmt.close)
    if at < 0:
        stripped = text.lstrip()
        if stripped.startswith(fmt.open):  # cut short while thinking
            return stripped[len(fmt.open) :].strip(), ""
        return None, text
    reasoning = text[:at]
    start = reasoning.find(fmt.open)
    if start >= 0:
        reasoning = reasoning[start + len(fmt.open) :]
    return reasoning.strip(), text[at + len(fmt.close) :].lstrip()


class ReasoningGate:
    """A logits processor for one row: thinking first, then `inner` (a grammar processor, or
    None for free text). `prompt_open`: the prompt already ends in the opening marker."""

    keeps_logits = True  # its input is copied before any write, and `inner` keeps it too

    def __init__(self, inner: Any, vocabulary: TokenVocabulary, fmt: ReasoningFormat, *,
                 max_new_tokens: int, budget: int | None = None, prompt_open: bool = False,
                 reserve: int | None = None) -> None:  # fmt: skip
        self.inner, self.fmt = inner, fmt
        self.max_new_tokens = max_new_tokens
        self.budget = budget
        # Room left for the answer: a grammar needs its document; free text a little.
        self.reserve = reserve if reserve is not None else min(256, max_new_tokens // 2)
        self.open_ids = list(vocabulary.encode(fmt.open.encode())) if vocabulary.encode else []
        self.close_ids = list(vocabulary.encode(fmt.close.encode())) if vocabulary.encode else []
        if not self.close_ids:
            raise ValueError("reasoning: the vocabulary cannot encode the closing marker")
        self.token_bytes = vocabulary.token_bytes
        self.eos = sorted(vocabulary.eos_token_ids)
        self.close_bytes = fmt.close.encode()
        self.phase = "thinking" if prompt_open else "opening"
        self.generated = 0  # tokens of this answer so far
        self.thinking = 0  # tokens of thinking (markers aside)
        self.text = bytearray()  # the thinking's bytes, to see the closing marker
        self.forcing: list[int] = [] if prompt_open else list(self.open_ids)
        self.start: int | None = None  # input_ids' column where the answer after it begins
        self.width: int | None = None
        self.forced_close = False

    def _only(self, logits: torch.Tensor, token: int) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[:, token] = logits[:, token]
        return out

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        if self.width is not None:  # the tokens sampled since the last call
            for column in range(self.width, width):
                self._took(int(input_ids[0, column]))
        self.width = width
        if self.phase == "answer":
            if self.start is None:
                self.start = width - 1
                if self.inner is not None:  # its budget counts from here
                    self.inner.max_new_tokens = max(1, self.max_new_tokens - self.generated)
            return logits if self.inner is None else self.inner(input_ids[:, self.start :], logits)
        if not self.forcing and self.phase == "thinking":
            left = self.max_new_tokens - self.generated
            over = self.budget is not None and self.thinking >= self.budget
            if over or left <= self.reserve + len(self.close_ids):
                self.forcing, self.forced_close = list(self.close_ids), True
        if self.forcing:
            return self._only(logits, self.forcing[0])
        if self.inner is not None and self.eos:  # an answer is due: no end while thinking
            logits = logits.clone()
            logits[:, self.eos] = float("-inf")
        return logits

    def _took(self, token: int) -> None:
        self.generated += 1
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
            if not self.forcing and self.phase == "opening":
                self.phase = "thinking"
            elif not self.forcing and self.forced_close:
                self.phase = "answer"
            return
        if self.phase != "thinking":  # the answer's tokens (or an opening not reached)
            return
        self.thinking += 1
        self.text += self.token_bytes.get(token, b"")
        if self.text.endswith(self.close_bytes):
            self.thinking -= len(self.close_ids)  # the marker is not thinking
            self.phase = "answer"
