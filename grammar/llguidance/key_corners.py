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

Most searches end at their first node: one byte the grammar allows that leaves the written
names shows the key is no corner. So before its mask a node tries a few likely bytes with
`validate_tokens` (a few us each against ~130 us for a mask inside `generate`): the next
bytes of the schema's property names (`with_names`), then a letter for names the schema
leaves free. A greedy verdict's token is held by the row's matcher, so its first node is
taken on that matcher itself, rolled back after, instead of on a deep copy (`_quick`); and a
row remembers its answers for the state (`memo`), since a verdict that cannot tell is
followed by the mask's screen, which asks about the same token. JSONSchemaBench sample
(`--per-category 2`), 2554 look-aheads: 210 -> 76 ms in all, the same answers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from quantkit.grammar.llguidance.distinct_items import DistinctItems
from quantkit.grammar.verdict import keeps
from quantkit.grammar.vocabulary import byte_tokens

__all__ = ["KeyCorners", "NODES", "TOP"]

# Enough for every written name of a large object to be among the model's best: with 8, a
# held-out Vega-Lite output whose 8 best tokens were all corners took the 9th, a corner too,
# and wrote "y", "color" and "shape" again. A safe token ends the screen, so the cost is paid
# only where the model's favourites are corners.
TOP = 64
NODES = 64
_QUOTE = ord('"')
# Schema names' bytes `_leaves_named` tries before a mask.
_TRIES = 4
_ANY_NAME = b"ae"


class KeyCorners:
    """The look-ahead for one vocabulary: its single-byte tokens."""

    _cache: dict[str, KeyCorners] = {}

    def __init__(self, vocabulary: Any) -> None:
        self.token_bytes = vocabulary.token_bytes
        self.byte_token = byte_tokens(vocabulary)
        self.words = (vocabulary.size + 31) // 32
        # The single-byte tokens as arrays, to read their bits out of a mask at once (`_dead`:
        # a Python loop over the 256 of them took ~28 us a node warm, this ~2).
        singles = sorted(self.byte_token.items())
        self._single_bytes = np.array([b for b, _ in singles], dtype=np.uint8)
        tokens = np.array([t for _, t in singles], dtype=np.int64)
        self._single_words, self._single_shifts = tokens >> 5, (tokens & 31).astype(np.uint32)
        # The schema's property names as JSON writes them between the quotes (`with_names`):
        # the bytes `_dead` tries before it computes a mask.
        self.names: frozenset[bytes] = frozenset()

    def with_names(self, names: Iterable[bytes]) -> KeyCorners:
        """This look-ahead for one schema: `_dead` first tries the next byte of the schema's
        property names that go on from a key's text (one `validate_tokens` each, a few us,
        against ~140 us for a mask inside `generate`); one the grammar allows that leaves the
        written keys proves the key not dead without the mask. The answers are the same:
        the names only choose which bytes are tried first. names: as written between the
        quotes (`warm.json_name`), in UTF-8."""
        found = copy.copy(self)
        found.names = frozenset(names)
        return found

    @classmethod
    def of(cls, vocabulary: Any) -> KeyCorners:
        found = cls._cache.get(vocabulary.fingerprint)
        if found is None:
            found = cls._cache[vocabulary.fingerprint] = cls(vocabulary)
        return found

    def screen(self, state: DistinctItems, matcher: Any, line: np.ndarray,
               scores: np.ndarray, memo: dict[int, bool] | None = None) -> list[int]:  # fmt: skip
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
            if not self._cornered(state, lambda t=token: _after(matcher, t), token, memo=memo):
                return cleared  # safe
            if int(np.bitwise_count(words).sum()) <= 1:
                return cleared  # never the last token: a dead end is worse than a repeat
            words[token >> 5] &= ~np.uint32(1 << (token & 31))
            scores[token] = -np.inf
            cleared.append(token)
        return cleared

    def clear_of(self, state: DistinctItems, after: Callable[[], Any], token: int,
                 held: Any = None, memo: dict[int, bool] | None = None) -> bool:  # fmt: skip
        """Whether `screen` would keep `token` were it the best allowed token: it leads into
        no corner (told by the same search). after: a copy of the row's matcher advanced by
        `token` (None where it refuses it), asked only where a key is in question; held: the
        row's own matcher advanced by `token`, if it is (a verdict's), asked first and left
        as it was found (`_quick`); memo: the answers found in this state so far, by token
        (the row's: a verdict that could not tell is followed by the mask's screen, which
        asks about the same token again)."""
        return not _has_written_keys(state) or not self._cornered(state, after, token, held,
                                                                  memo)  # fmt: skip

    def _cornered(self, state: DistinctItems, after: Callable[[], Any], token: int,
                  held: Any = None, memo: dict[int, bool] | None = None) -> bool:  # fmt: skip
        """Whether `token` (allowed here) leads into a corner: it leaves a key whose text so
        far begins a written key's name, and every way on from there that the grammar allows
        ends as a written key (`_dead`, on `after()`, a copy of the matcher past `token`;
        first `_quick` on `held` where given, which most often tells without the copy). Kept
        in `memo` where given."""
        if memo is None:
            return self._search(state, after, token, held)
        found = memo.get(token)
        if found is None:
            found = memo[token] = self._search(state, after, token, held)
        return found

    def _search(self, state: DistinctItems, after: Callable[[], Any], token: int,
                held: Any) -> bool:  # fmt: skip
        """`_cornered`'s answer, searched."""
        near = self._near(state, token)
        if near is None:
            return False
        name, written, quote = near
        if held is not None:
            found = self._quick(held, name, written, quote)
            if found is not None:
                return found
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
        found, name, _ = self._follow(matcher, name, written)
        if found is not None:
            return found
        seen[0] += 1
        if seen[0] > NODES:
            return False
        nexts = _nexts(name, written)
        if self._leaves_named(matcher, name, written, nexts):
            return False
        scratch = np.zeros(self.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        bits = scratch.view(np.uint32)
        allowed = (bits[self._single_words] >> self._single_shifts) & 1
        for byte in self._single_bytes[allowed.astype(bool)].tolist():
            if byte == _QUOTE:
                if name not in written:
                    return False  # a new key ends here
                continue
            if byte not in nexts:
                return False  # the name leaves every written key's
        for byte in nexts:
            token = self.byte_token.get(byte)
            if token is None or not keeps(bits, token):
                continue
            copy = matcher.deep_copy()
            if copy.consume_token(token) and not self._dead(copy, name + bytes([byte]), written,
                                                            seen):  # fmt: skip
                return False
        return True

    def _quick(self, matcher: Any, name: bytes, written: set[bytes], quote: bool
               ) -> bool | None:  # fmt: skip
        """`_cornered`'s answer told on `matcher` itself (past the token) without a copy or a
        mask, or None where `_dead` needs its mask: the opening quote, the forced bytes and
        `_leaves_named`, as `_cornered` and `_dead` take them. Each byte is taken with
        `try_consume_tokens` (a refused one leaves the matcher as it was, where
        `consume_token` would leave it in error) and all are rolled back, so the matcher ends
        as it began (a deep copy cost ~10 us inside `generate`)."""
        taken = 0
        try:
            if quote:
                opener = self.byte_token.get(_QUOTE)
                if opener is None or matcher.try_consume_tokens([opener]) != 1:
                    return False
                taken += 1
            found, name, forced = self._follow(matcher, name, written)
            taken += forced
            if found is not None:
                return found
            nexts = _nexts(name, written)
            return False if self._leaves_named(matcher, name, written, nexts) else None
        finally:
            if taken:
                matcher.rollback(taken)

    def _follow(self, matcher: Any, name: bytes, written: set[bytes]
                ) -> tuple[bool | None, bytes, int]:  # fmt: skip
        """Follow the bytes the grammar forces after the key's text `name` (`compute_ff_bytes`,
        each taken with `try_consume_tokens`, which leaves the matcher as it was where it
        refuses one): (whether the key is dead where they tell, else None; the text after them; the
        tokens consumed). They tell where they close the key (dead if it is a written one),
        leave every written name, or cannot be followed (not shown dead)."""
        taken = 0
        for byte in matcher.compute_ff_bytes():
            if byte == _QUOTE:
                return name in written, name, taken  # the only way on ends the key here
            name += bytes([byte])
            if not any(w.startswith(name) for w in written):
                return False, name, taken  # leaves every written key's name
            token = self.byte_token.get(byte)
            if token is None or matcher.try_consume_tokens([token]) != 1:
                return False, name, taken  # cannot be followed here: not shown dead
            taken += 1
        return None, name, taken

    def _leaves_named(self, matcher: Any, name: bytes, written: set[bytes], nexts: set[int]
                      ) -> bool:  # fmt: skip
        """Whether the matcher takes a byte that `_dead`'s mask would show leaves the written
        keys, among the next bytes of the schema's names that go on from `name` and a letter
        (at most `_TRIES` of them, each asked with `validate_tokens`): a name's closing quote
        where that name is not written, else a byte no written name has next (not in
        `nexts`, `_nexts`)."""
        size = len(name)
        tries = sorted({n[size] for n in self.names if len(n) > size and n.startswith(name)}
                       - nexts)  # fmt: skip
        if name in self.names and name not in written:
            tries.append(_QUOTE)
        # Then a letter for names the schema leaves free (additional or pattern properties).
        tries += [b for b in _ANY_NAME if b not in nexts and b not in tries][:1]
        for byte in tries[:_TRIES]:
            token = self.byte_token.get(byte)
            if token is not None and matcher.validate_tokens([token]) == 1:
                return True
        return False


def _nexts(name: bytes, written: set[bytes]) -> set[int]:
    """The bytes the written names that go on from `name` have next."""
    return {w[len(name)] for w in written if len(w) > len(name) and w.startswith(name)}


def _after(matcher: Any, token: int) -> Any:
    """A copy of `matcher` advanced by `token`, or None where it refuses it."""
    copy = matcher.deep_copy()
    return copy if copy.consume_token(token) else None


def _has_written_keys(state: DistinctItems) -> bool:
    """Whether the text state checks keys and an open object has written some."""
    return bool(state.keys) and any(not f.array and f.keys for f in state.stack)
