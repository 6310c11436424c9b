"""Token log-probabilities in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}, ...]}`, top_logprobs exactly the `top_logprobs` asked for, most likely first.

Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
each top_logprobs entry a dict token -> logprob of the `logprobs` most likely tokens plus the
chosen one (so up to N + 1 entries, as OpenAI says), None for the first prompt token, which has
no context (with `echo`). text_offset: where each token's text starts in the choice's returned
text (the prompt's first with echo), counted over the tokens' own texts.

The values are `quantkit.runtime.scoring`'s: the log-softmax of the model's logits, before any
logits processor (penalties, a grammar mask) and before temperature and the filters. A token's
text is the tokenizer's decoding of it alone; its bytes are that text's UTF-8 (a token that is
part of a multi-byte character decodes to U+FFFD, as vLLM returns it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quantkit.runtime.scoring import TokenLogprob

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs"]

# JSON has no -Infinity: a token the model gives no probability at all gets this (vLLM's value).
_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob > _FLOOR else _FLOOR


class TokenTexts:
    """Each token id's text, decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self._texts[token] = text
        return text


def _chat_entry(texts: TokenTexts, token: int, logprob: float) -> dict[str, Any]:
    text = texts(token)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` for generated tokens."""
    content = []
    for entry in entries:
        item = _chat_entry(texts, entry.token, entry.logprob)
        item["top_logprobs"] = [_chat_entry(texts, t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    texts: TokenTexts,
    *,
    offset: int = 0,
) -> tuple[dict[str, Any], int]:
    """A completion choice's (or chunk's) `logprobs` for tokens `ids` (their `entries`, None
    where a token has no context), text offsets from `offset`; and the offset after them."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token, entry in zip(ids, entries, strict=True):
        text = texts(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(entry.logprob))
        top = {texts(t): _value(lp) for t, lp in entry.top}
        top.setdefault(text, _value(entry.logprob))
        out["top_logprobs"].append(top)
    return out, offset
