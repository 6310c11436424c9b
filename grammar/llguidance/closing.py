"""Finishing within the token budget on the llguidance path: a short way to complete the
document from where a row stands, found by walking a copy of its matcher.

outlines-core rows know their distance to completion exactly (`budget`: a breadth-first search
over the regex's automaton). An llguidance grammar has no automaton to search: it is an Earley
parser over a lazy lexer, and its states have no names. What it can answer cheaply is whether
one token is allowed (`validate_tokens`, ~1 us) and which bytes are forced (`compute_ff_bytes`).
So `ClosingWalk.path` walks a copy of the row's matcher one byte at a time, taking the forced
bytes whole and otherwise the first allowed byte of a fixed preference: the bytes that close
something (`"`, `}`, `]`), then `,` (the next required property or item), then the shortest
values (`0`, a letter for a string that needs one, `t`/`f`/`n` for literals), then any byte.
The path it returns is a complete document's tail, not always the shortest one (a greedy choice
can open a string whose pattern needs ten bytes where a number needed one), and its length in
bytes bounds the tokens it needs from above.

The processor (`processor.GrammarLogitsProcessor`) walks a row when its tokens left come near
the last path's length, and inside `budget.WINDOW` tokens of it allows only the tokens that
follow the path (`along`): each writes at least one of its bytes, so the document closes in
time. Measured on the embedded model's vocabulary: a walk takes 50-150 us for the tails of
ordinary schemas. It gives up at `limit` bytes, or as soon as it goes round in a loop (an
email address: `}` is allowed inside one for ever, and only an `@` would lead on), and the row
is then left unsteered until its next walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quantkit.grammar.llguidance.runaway import MAX_PERIOD, REPEAT_BYTES, repeats
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["ClosingWalk"]

# The bytes tried first, in order (see the module docstring); every other byte comes after.
_PREFERRED = b'"}],0:a1tfn{[-.e '


class ClosingWalk:
    """Per vocabulary: its single-byte tokens in the order a walk tries them, and the lookup of
    tokens by their bytes that `along` needs."""

    _cache: dict[str, ClosingWalk] = {}

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        byte_token: dict[int, int] = {}
        by_bytes: dict[bytes, int] = {}
        for token, data in sorted(vocabulary.token_bytes.items()):
            by_bytes.setdefault(data, token)
            if len(data) == 1:
                byte_token.setdefault(data[0], token)
        self.byte_token = byte_token
        first = [byte_token[b] for b in _PREFERRED if b in byte_token]
        rest = [t for b, t in sorted(byte_token.items()) if b not in _PREFERRED]
        self.order = first + rest
        self.by_bytes = by_bytes
        self.longest = max((len(d) for d in by_bytes), default=1)
        self.token_bytes = vocabulary.token_bytes

    @classmethod
    def of(cls, vocabulary: TokenVocabulary) -> ClosingWalk:
        found = cls._cache.get(vocabulary.fingerprint)
        if found is None:
            found = cls._cache[vocabulary.fingerprint] = cls(vocabulary)
        return found

    def path(
        self, matcher: Any, *, limit: int, allows: Callable[[bytes], bool] | None = None
    ) -> tuple[bytes, bool]:
        """(bytes, complete): the bytes a copy of `matcher` took to reach an accepting state
        (complete), or the first `limit` of them / up to where no single byte was allowed
        (not complete). `matcher` itself is not touched. allows: a check of the row's own
        beside the grammar's (distinct keys: `distinct_items.DistinctRow`), asked of each
        byte before it is taken, which then counts it as written."""
        walker = matcher.deep_copy()
        out = bytearray()
        while len(out) < limit:
            if walker.is_accepting():
                return bytes(out), True
            forced = walker.compute_ff_bytes()
            tokens = [self.byte_token.get(b) for b in forced[: limit - len(out)]]
            if forced and None not in tokens:
                taken = walker.try_consume_tokens(tokens)
                if allows is not None and taken and not allows(forced[:taken]):
                    return bytes(out), False  # the grammar forces a repeated key: no way on
                out += forced[:taken]
                if taken:
                    continue
            for token in self.order:
                if walker.validate_tokens([token]) and (
                    allows is None or allows(self.token_bytes[token])
                ):
                    walker.consume_token(token)
                    out += self.token_bytes[token]
                    break
            else:
                return bytes(out), False  # only multi-byte tokens go on (or none at all)
            if len(out) >= REPEAT_BYTES and repeats(out[-3 * MAX_PERIOD :]):
                return bytes(out), False  # going round: a string no preferred byte closes
        return bytes(out), bool(walker.is_accepting())

    def along(self, path: bytes) -> list[int]:
        """The tokens whose bytes begin `path` (each writes at least one of its bytes)."""
        found = []
        for size in range(1, min(len(path), self.longest) + 1):
            token = self.by_bytes.get(path[:size])
            if token is not None:
                found.append(token)
        return found
