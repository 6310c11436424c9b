"""Keys that can only end as a key written before: seen one step ahead of the model's choice.

An object whose declared names llguidance takes in any order (names made patterns, `order`)
lets a row write the text of a key its object already has (`{"lineNumber":2,"lineNumber`):
from there only the closing quote is allowed, which would repeat the key. The row's distinct-
key check (`distinct_items.DistinctRow`) then has to let the repeat through or stop in a dead
end, and a greedy model goes round the same key again and again (`"lineNumber":2` forty times
in one held-out output).

`KeyCorners.screen` keeps the row out of that corner. Given the row's mask and this step's
logits already masked by it (disallowed tokens -inf), it takes the allowed tokens best first
by arg-max (at most `TOP` of them); a token that would leave the key's text a prefix of a key
already written is tried on a copy of the matcher: if from there every continuation the
grammar allows leads back to a written key (a search over single bytes along the written
keys' names, at most `NODES` masks), the token is cleared (its bit, and its score set to -inf)
and the next arg-max is taken; the first token that is safe ends the screen. So the token a
greedy decoder takes is never a corner; under sampling, the tokens below the top `TOP` are
not screened. Where no open object has a written key a screen costs nothing; elsewhere one
arg-max over the masked logits (~15 us for 49k); inside a key, one mask per name character.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from quantkit.grammar.llguidance.distinct_items import DistinctItems
from quantkit.grammar.vocabulary import byte_tokens

__all__ = ["KeyCorners", "NODES", "TOP"]

# Enough for every written name of a large object to be among the model's best: with 8, a
# held-out Vega-Lite output whose 8 best tokens were all corners took the 9th, a corner too,
# and wrote "y", "color" and "shape" again. A safe token ends the screen, so the cost is paid
# only where the model's favourites are corners.
TOP = 64
NODES = 64
_QUOTE = ord('"')


class KeyCorners:
    """The look-ahead for one vocabulary: its single-byte tokens."""

    _cache: dict[str, KeyCorners] = {}

    def __init__(self, vocabulary: Any) -> None:
        self.token_bytes = vocabulary.token_bytes
        self.byte_token = byte_tokens(vocabulary)
        self.words = (vocabulary.size + 31) // 32

    @classmethod
    def of(cls, vocabulary: Any) -> KeyCorners:
        found = cls._cache.get(vocabulary.fingerprint)
        if found is None:
            found = cls._cache[vocabulary.fingerprint] = cls(vocabulary)
        return found

    def screen(self, state: DistinctItems, matcher: Any, line: np.ndarray,
               scores: np.ndarray) -> list[int]:  # fmt: skip
        """Clear the best tokens of `line` that lead into a corner (see the module docstring),
        and set their `scores` (this step's logits masked by `line`: -inf where not allowed)
        to -inf; the tokens cleared. Ties go to the lower id (the first arg-max)."""
        cleared: list[int] = []
        if not _has_written_keys(state):
            return cleared  # no open object has written keys: no corner to enter
        words = line.view(np.uint32)
        for _ in range(min(TOP, scores.size)):
            token = int(scores.argmax())
            if scores[token] == -np.inf:
                return cleared  # nothing allowed is left with a finite score
            if not self._cornered(state, lambda t=token: _after(matcher, t), token):
                return cleared  # safe
            if int(np.bitwise_count(words).sum()) <= 1:
                return cleared  # never the last token: a dead end is worse than a repeat
            words[token >> 5] &= ~np.uint32(1 << (token & 31))
            scores[token] = -np.inf
            cleared.append(token)
        return cleared

    def clear_of(self, state: DistinctItems, after: Callable[[], Any], token: int) -> bool:
        """Whether `screen` would keep `token` were it the best allowed token: it leads into
        no corner (told by the same search). after: a copy of the row's matcher advanced by
        `token` (None where it refuses it), asked only where a key is in question."""
        return not _has_written_keys(state) or not self._cornered(state, after, token)

    def _cornered(self, state: DistinctItems, after: Callable[[], Any], token: int) -> bool:
        """Whether `token` (allowed here) leads into a corner: it leaves a key whose text so
        far begins a written key's name, and every way on from there that the grammar allows
        ends as a written key (`_dead`, on `after()`, a copy of the matcher past `token`)."""
        near = self._near(state, token)
        if near is None:
            return False
        name, written, quote = near
        copy = after()
        if copy is None:
            return False
        opener = self.byte_token.get(_QUOTE)
        if quote and (opener is None or not copy.consume_token(opener)):
            return False
        return self._dead(copy, name, written, [0])

    def _near(self, state: DistinctItems, token: int) -> tuple[bytes, set[bytes], bool] | None:
        """Where `token` leaves a key whose text so far begins a written key's name: (that
        text, the written names, whether its opening quote is still to come); None when it
        leaves no such key (safe). A token can close a string value and begin a key at once
        (`","`), so it is fed to a probe of the text state rather than read by its first
        byte."""
        where = state.key_after(self.token_bytes.get(token, b""))
        if where is None:
            return None  # leaves no key of an object with written keys
        keys, name, quote = where
        written = {k[1:-1] for k in keys}
        if not any(w.startswith(name) for w in written):
            return None  # leaves written keys' names
        return name, written, quote

    def _dead(self, matcher: Any, name: bytes, written: set[bytes], seen: list[int]) -> bool:
        """Whether every continuation of the key `name` the grammar allows ends as a written
        key (a search over single bytes; at NODES masks it gives up: not dead). The bytes the
        grammar forces are followed without a mask (`compute_ff_bytes`): with names as
        patterns, a written name's letters after its first are usually forced, so a search
        costs about one mask per branching of the written names, not one per letter."""
        for byte in matcher.compute_ff_bytes():
            if byte == _QUOTE:
                return name in written  # the only way on ends the key here
            name += bytes([byte])
            if not any(w.startswith(name) for w in written):
                return False  # leaves every written key's name
            token = self.byte_token.get(byte)
            if token is None or not matcher.consume_token(token):
                return False  # cannot be followed here: not shown dead
        seen[0] += 1
        if seen[0] > NODES:
            return False
        scratch = np.zeros(self.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        bits = scratch.view(np.uint32)
        nexts = {w[len(name)] for w in written if len(w) > len(name) and w.startswith(name)}
        for byte, token in self.byte_token.items():
            if not (bits[token >> 5] >> (token & 31)) & 1:
                continue
            if byte == _QUOTE:
                if name not in written:
                    return False  # a new key ends here
                continue
            if byte not in nexts:
                return False  # the name leaves every written key's
        for byte in nexts:
            token = self.byte_token.get(byte)
            if token is None or not (bits[token >> 5] >> (token & 31)) & 1:
                continue
            copy = matcher.deep_copy()
            if copy.consume_token(token) and not self._dead(copy, name + bytes([byte]), written,
                                                            seen):  # fmt: skip
                return False
        return True


def _after(matcher: Any, token: int) -> Any:
    """A copy of `matcher` advanced by `token`, or None where it refuses it."""
    copy = matcher.deep_copy()
    return copy if copy.consume_token(token) else None


def _has_written_keys(state: DistinctItems) -> bool:
    """Whether the text state checks keys and an open object has written some."""
    return bool(state.keys) and any(not f.array and f.keys for f in state.stack)
