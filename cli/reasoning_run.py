"""`quantkit generate` with a reasoning model: the thinking first, then the answer's grammar
(`quantkit.grammar.reasoning`), kept out of the thin CLI module."""

from __future__ import annotations

from typing import Any

from quantkit.grammar.reasoning import ReasoningGate, reasoning_for
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["reasoning_gate"]


def reasoning_gate(loaded: Any, prompt_ids: list[int], processors: list[Any], *, eos: set[int],
                   chat: bool | None, max_new_tokens: int,
                   budget: int | None) -> ReasoningGate | None:  # fmt: skip
    """The gate for a model whose chat template speaks of thinking, wrapping the grammar
    processor (at most one); None for other models, or with --no-chat."""
    tokenizer = loaded.tokenizer
    fmt = reasoning_for(getattr(tokenizer, "chat_template", None))
    if fmt is None or chat is False or len(processors) > 1:
        return None
    inner = processors[0] if processors else None
    vocabulary = inner.vocabulary if inner is not None else TokenVocabulary.from_tokenizer(
        tokenizer, eos_token_ids=eos, vocab_size=loaded.config.get("vocab_size"))  # fmt: skip
    tail = tokenizer.decode(prompt_ids[-8:]).rstrip()
    return ReasoningGate(inner, vocabulary, fmt, max_new_tokens=max_new_tokens, budget=budget,
                         prompt_open=tail.endswith(fmt.open))  # fmt: skip
