"""Generated tokens to streamed text: incremental detokenization and stop strings.

Two small state machines, one per sequence, kept apart from the decode loop so each is tested on
its own:

- `IncrementalDetokenizer` turns one token at a time into the text it adds. Decoding a token
  alone is wrong in general (a multi-byte character split over tokens decodes to U+FFFD until
  its last byte arrives; SentencePiece drops a leading space at the start of a string), and
  decoding the whole list every step costs O(n) per token. It keeps vLLM's two offsets instead:
  decode a short window ending at the last emitted token and the same window plus the new
  tokens, and emit the difference once it no longer ends in U+FFFD.
- `StopStringStream` accumulates that text, cuts it at the first stop string, and holds back
  a tail that could still become one, so a streamed stop string is never half printed.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text a growing token list adds, token by token; special tokens are skipped."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # start of the decode window (context for the next token's text)
        self._read = 0  # tokens before this index have had their text emitted

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add `token`; return the text it completes ("" while a character is unfinished)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (an unfinished character decodes to U+FFFD)."""
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return after[len(before) :]


class StopStringStream:
    """Text so far, cut at the first stop string; `feed` says what is safe to show now.

    `text` is the output (the stop string and anything after it removed); `stopped` is True once
    a stop string was found, after which further text is ignored.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.stopped = False
        self._emitted = 0

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(self.text), self._longest - 1), 0, -1):
            tail = self.text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stop):
                return k
        return 0

    def feed(self, delta: str) -> str:
        """Append `delta`; return the text that became safe to show (maybe "")."""
        if self.stopped or not delta:
            return ""
        # A stop string that ends in `delta` starts at most longest - 1 characters before it.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            safe = len(self.text)
        else:
            safe = len(self.text) - self._held_back()
        out = self.text[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return out

    def finish(self) -> str:
        """The held-back tail, released because no more text is coming."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
