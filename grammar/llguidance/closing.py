"""Finishing within the token budget on the llguidance path: a short way to complete the
document from where a row stands, found by walking a copy of its matcher.

outlines-core rows know their distance to completion exactly (`budget`: a breadth-first search
over the regex's automaton). An llguidance grammar has no automaton to search: it is an Earley
parser over a lazy lexer, and its states have no names. What it can answer cheaply is whether
one token is allowed (`validate_tokens`, ~1 us) and which bytes are forced (`compute_ff_bytes`).
So `ClosingWalk.path` walks a copy of the row's matcher one byte at a time, taking the forced
bytes whole and otherwise the first allowed byte of a fixed preference: the bytes that close
something (`"`, `}`, `]`, `)`, `;`, a newline), then `,` (the next required property or item),
then the shortest
values (`0`, a letter for a string that needs one, `t`/`f`/`n` for literals), then any byte.
A walk that went round takes last, at each choice, the bytes that followed the same 16 bytes
(else 8, else 4) before, in the row's text or its own, unless they close something: a
recursion the preferences would follow for ever (a spec whose "spec" is a spec again, or a
leaf) is left at the branch it took each time round, and a list at the `,` that continued it.
Inside one lexeme (a string whose pattern or format no preferred byte ends: an email's local
part goes round on any of its bytes, and only an `@` leads on), a walk that went round
searches for the way out before each byte it takes (`_Exit`): the fewest bytes, one of each
class (the digits, the letters, any other byte alone), after which a closing byte it could not
take is allowed (the domain's `.aa"`), else a byte that leaves the lexeme's state for good (the
`@`). Taking one more byte last at each turn of the loop instead (`0000a0000t0000f…`), the
walk of JSONSchemaBench's "JsonSchemaStore 0.5.2" email ran past its limit, and the row
followed it to the token limit.
The path it returns is a complete document's tail, not always the shortest one (a greedy choice
can open a string whose pattern needs ten bytes where a number needed one), and its length in
bytes bounds the tokens it needs from above.

The processor (`processor.GrammarLogitsProcessor`) walks a row when its tokens left come near
the last path's length, and inside `budget.WINDOW` tokens of it allows only the tokens that
follow the path (`along`): each writes at least one of its bytes, so the document closes in
time. Measured on the embedded model's vocabulary: a walk takes 50-150 us for the tails of
ordinary schemas. It gives up at `limit` bytes, or when it goes round in a loop (an email
address in a vocabulary without an `@`: `}` is allowed inside one for ever) and still goes
round `_GRACE` bytes after trying to close at every byte (a repeat the grammar asks for, seven
booleans of a `minItems: 7` array, ends within that), and the row is then left unsteered until
its next walk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quantkit.grammar.llguidance.runaway import MAX_PERIOD, REPEAT_BYTES, repeats
from quantkit.grammar.vocabulary import TokenVocabulary, byte_tokens

__all__ = ["ClosingWalk"]

# A walk checks every 16 bytes whether it goes round in steps of up to this many bytes.
_LOOP = 128
# A walk that goes round again after `finishing` begins walks on this many bytes before it
# gives up: a repeat the grammar asks for ends within it.
_GRACE = 256
# A walk going round takes last the bytes among the last this many at each sighting, until
# it takes a byte that ends a value or an item (`_LEXEME_ENDS`).
_RECENT = 16
_LEXEME_ENDS = frozenset(b'"}],:')
# A walk that went round takes last at each choice the bytes that followed the same last this
# many bytes before (else 8, else 4; in the row's text or the walk's own), except the closing
# ones (`_KEEP`): a recursion (a spec whose "spec" is a spec again) is left at the branch it
# took each time round, wherever that lies in the loop, and a list at its `,`.
_CONTEXT = 16
_KEEP = frozenset(b'"}]')
# The walk orders kept (`_order`): a few dozen pairs of byte sets recur across a row's walks.
_ORDERS = 1024
# The bytes that may end a text at once, tried first by a walk that goes round.
_CLOSERS = b'"}]);\n'
# The bytes tried first, in order (see the module docstring); every other byte comes after.
_PREFERRED = b'"}]);\n,0:a1tfn{[-.e '
# A walk that went round, inside one lexeme (none of its last this many bytes a `"`, `,` or
# `:`), looks for the lexeme's way out (`_Exit`) before each byte it takes: up to this many
# bytes before a closing byte not allowed where it looks, trying at most `_EXIT_TRIES` bytes,
# `_EXIT_SEARCHES` times a walk. The steps it tries neither open nor end a value.
_IN_LEXEME = 8
_OUTSIDE = frozenset(b'",:')
_NOT_STEPS = _LEXEME_ENDS | frozenset(_CLOSERS) | frozenset(b"{[")
_EXIT_DEPTH = 3
_EXIT_TRIES = 512
_EXIT_SEARCHES = 8


class ClosingWalk:
    """Per vocabulary: its single-byte tokens in the order a walk tries them, and the lookup of
    tokens by their bytes that `along` needs."""

    _cache: dict[str, ClosingWalk] = {}

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        by_bytes: dict[bytes, int] = {}
        for token, data in sorted(vocabulary.token_bytes.items()):
            by_bytes.setdefault(data, token)
        byte_token = self.byte_token = byte_tokens(vocabulary)
        first = [byte_token[b] for b in _PREFERRED if b in byte_token]
        rest = [t for b, t in sorted(byte_token.items()) if b not in _PREFERRED]
        self.order = first + rest
        self.closers = [byte_token[b] for b in _CLOSERS if b in byte_token]
        self.by_bytes = by_bytes
        # The longest token that begins with each two bytes (`along` tries no longer prefix of
        # a path: SmolLM2's longest token is 81 bytes, 99% of them 14 or fewer).
        reach: dict[bytes, int] = {}
        for data in by_bytes:
            if len(data) >= 2 and len(data) > reach.get(data[:2], 0):
                reach[data[:2]] = len(data)
        self._reach = reach
        self.token_bytes = vocabulary.token_bytes
        self._orders: dict[tuple[frozenset[int], frozenset[int]], list[int]] = {}

    @classmethod
    def of(cls, vocabulary: TokenVocabulary) -> ClosingWalk:
        found = cls._cache.get(vocabulary.fingerprint)
        if found is None:
            found = cls._cache[vocabulary.fingerprint] = cls(vocabulary)
        return found

    def path(
        self,
        matcher: Any,
        *,
        limit: int,
        allows: Callable[[], Callable[[bytes], bool]] | None = None,
        finishing: bool = False,
        tail: bytes = b"",
    ) -> tuple[bytes, bool]:
        """(bytes, complete): the bytes a copy of `matcher` took to reach an accepting state
        (complete), or the first `limit` of them / up to where no single byte was allowed
        (not complete). `matcher` itself is not touched. allows: makes a check of the row's
        own beside the grammar's (distinct keys: `distinct_items.DistinctRow`), asked of each
        byte before it is taken, which then counts it as written.

        A walk that goes round (a free line of text where `"` is always allowed and never
        ends it) is walked again `finishing`: at each byte, a closing byte that completes the
        text at once is taken first (tried and rolled back: ~20 us a byte, so only then).

        tail: the row's text before the walk (its last bytes), which the loop checks read in
        front of the walk's own: a row already in a run of zeros must not be sent down a path
        that begins with more of them (each walk would then start the run again)."""
        walker = matcher.deep_copy()
        check = None if allows is None else allows()
        out = bytearray()
        seen_text = bytearray(tail[-3 * _LOOP :])  # the tail, then `out`: what loops are read in
        looped = 0  # finishing: where the loop under way began (0: none)
        avoid: set[int] = set()  # finishing: the bytes of the loops under way, taken last
        # finishing (this walk went round before), until a loop's length passes without going
        # round: the bytes that followed the walk's last `_CONTEXT` before are taken last
        # (`_followers`), from the first byte: a recursion is left in its first level.
        recall = finishing
        if finishing and self._repeating(seen_text):  # the row's own text goes round already
            avoid = set(seen_text[-_RECENT:])
        seen = 0  # finishing: where the walk was last seen going round
        exits = _Exits()
        while len(out) < limit:
            if walker.is_accepting():
                return bytes(out), True
            forced = walker.compute_ff_bytes()
            tokens = [self.byte_token.get(b) for b in forced[: limit - len(out)]]
            if forced and None not in tokens:
                taken = walker.try_consume_tokens(tokens)
                if check is not None and taken and not check(forced[:taken]):
                    return bytes(out), False  # the grammar forces a repeated key: no way on
                out += forced[:taken]
                seen_text += forced[:taken]
                if avoid and not _LEXEME_ENDS.isdisjoint(forced[:taken]):
                    avoid = set()  # a forced `":` ended the key: a value is chosen afresh
                if taken:
                    continue
            if finishing and self._finish(walker, check, out):
                return bytes(out), True
            # Going round, the bytes the loops held (the last `_RECENT` at each sighting) come
            # last until a value or item ends: a date-time's fraction goes round on `0` and
            # ends only at a `Z` or an offset.
            # Bytes that followed this text before come last, but a closing byte stays where it
            # is: a string closed empty last time round is closed empty again (a byte written
            # into it would change every context after it), and a closing bracket is the way
            # out. A `,` is not kept: it goes round once more.
            before = self._followers(seen_text) - _KEEP if recall else set()
            order = self._order(frozenset(avoid), frozenset(before))
            # Inside one lexeme: its way out, if one is near (`_Exit`).
            if finishing and _OUTSIDE.isdisjoint(seen_text[-_IN_LEXEME:]):
                way = exits.find(walker, self, order)[: limit - len(out)]
                taken = self._take(walker, check, way)
                out += taken
                seen_text += taken
                if not _LEXEME_ENDS.isdisjoint(taken):
                    avoid = set()
                if taken:
                    continue
            for token in order:
                if walker.validate_tokens([token]) and (
                    check is None or check(self.token_bytes[token])
                ):
                    walker.consume_token(token)
                    out += self.token_bytes[token]
                    seen_text += self.token_bytes[token]
                    if self.token_bytes[token][0] in _LEXEME_ENDS:
                        avoid = set()  # the looping value or item has ended
                    break
            else:
                return bytes(out), False  # only multi-byte tokens go on (or none at all)
            if self._going_round(seen_text):
                if not finishing:
                    return self.path(matcher, limit=limit, allows=allows, finishing=True,
                                     tail=tail)  # fmt: skip
                # A repeat the grammar asks for (seven booleans of a minItems 7 array) ends
                # within a bounded stretch; a free text never does: walk on `_GRACE` bytes.
                looped, seen, recall = looped or len(out), len(out), True
                avoid |= set(seen_text[-_RECENT:])
                if len(out) - looped >= _GRACE:
                    return bytes(out[:looped]), False
            elif (looped or recall) and len(out) - seen > _LOOP:
                looped, recall = 0, False  # the loop ended: an ordinary walk again
        if looped and not walker.is_accepting() and self._repeating(seen_text):
            return bytes(out[: min(looped, limit - 1)]), False  # round to the limit: no way
        if finishing and not walker.is_accepting() and self._stuck(seen_text):
            # Round to the limit in a loop the avoided bytes keep changing (an email's local
            # part: `}}}…0}}}…a}}}…`): no way either, or the row would follow it from its
            # first token.
            return bytes(out[: limit - 1]), False
        return bytes(out), bool(walker.is_accepting())

    def _take(self, walker: Any, check: Callable[[bytes], bool] | None,
              tokens: list[int]) -> bytes:  # fmt: skip
        """Consume `tokens` while each is allowed (and passes `check`); their bytes."""
        taken = bytearray()
        for token in tokens:
            data = self.token_bytes[token]
            if not walker.validate_tokens([token]) or (check is not None and not check(data)):
                break
            walker.consume_token(token)
            taken += data
        return bytes(taken)

    @staticmethod
    def _stuck(text: bytearray) -> bool:
        """Whether the text's last `_LOOP` bytes are mostly one byte written over and over."""
        window = text[-_LOOP:]
        return len(window) == _LOOP and max(window.count(b) for b in set(window)) * 2 > _LOOP

    def _finish(self, walker: Any, check: Callable[[bytes], bool] | None,
                out: bytearray) -> bool:  # fmt: skip
        """Take a closing byte after which the text is complete, if one is allowed."""
        for token in self.closers:
            if not walker.validate_tokens([token]):
                continue
            walker.consume_token(token)
            if walker.is_accepting() and (check is None or check(self.token_bytes[token])):
                out += self.token_bytes[token]
                return True
            walker.rollback(1)
        return False

    @staticmethod
    def _followers(text: bytearray) -> set[int]:
        """The bytes that followed `text`'s last `_CONTEXT` bytes where they occurred before, or
        its last 8 or 4 where the longer never did."""
        for size in (_CONTEXT, 8, 4):
            if len(text) <= size:
                continue
            context, last = bytes(text[-size:]), len(text) - size
            found, at = set(), text.find(context)
            while 0 <= at < last:
                found.add(text[at + size])
                at = text.find(context, at + 1)
            if found:
                return found
        return set()

    def _order(self, avoid: frozenset[int], before: frozenset[int]) -> list[int]:
        """The order a walk tries bytes in: the preferred order with the bytes in `avoid` moved
        last, then those in `before` (each move keeps the order within both parts). Made once
        per pair of sets: a walk asks for the same few at every byte."""
        key = (avoid, before)
        found = self._orders.get(key)
        if found is None:
            found = self.order
            for last in (avoid, before):
                if last:
                    found = self._taken_last(found, last)
            if len(self._orders) >= _ORDERS:
                self._orders.clear()
            self._orders[key] = found
        return found

    def _taken_last(self, order: list[int], last: frozenset[int]) -> list[int]:
        """`order` with the tokens of the bytes in `last` moved last."""
        fresh = [t for t in order if self.token_bytes[t][0] not in last]
        return fresh + [t for t in order if self.token_bytes[t][0] in last]

    @staticmethod
    def _repeating(out: bytearray) -> bool:
        """Whether the text ends in a repeat, in short or long steps (checked at any length)."""
        return repeats(out[-3 * MAX_PERIOD :]) or ClosingWalk._long_repeat(out)

    @staticmethod
    def _going_round(out: bytearray) -> bool:
        if len(out) >= REPEAT_BYTES and repeats(out[-3 * MAX_PERIOD :]):
            return True  # a string no preferred byte closes
        # in longer steps (a clause, an item), checked every 16 bytes
        return len(out) % 16 == 0 and ClosingWalk._long_repeat(out)

    @staticmethod
    def _long_repeat(out: bytearray) -> bool:
        """A piece of up to `_LOOP` bytes written over and over, 96 bytes in all: twice is
        enough for a piece of 48 bytes or more (a recursion's level: each time round after
        the first is a whole level of bytes spent)."""
        return repeats(out[-3 * _LOOP :], least=2, total=96, longest=_LOOP)

    def along(self, path: bytes) -> list[int]:
        """The tokens whose bytes begin `path` (each writes at least one of its bytes), the
        shortest first. Each prefix of the path is looked up, up to the longest token that
        begins with the path's first two bytes (`_reach`): a budget-steered row asks at every
        step, and its paths run to hundreds of bytes."""
        found = []
        token = self.by_bytes.get(path[:1]) if path else None
        if token is not None:
            found.append(token)
        for size in range(2, min(len(path), self._reach.get(path[:2], 0)) + 1):
            token = self.by_bytes.get(path[:size])
            if token is not None:
                found.append(token)
        return found


def _byte_class(byte: int) -> int:
    """The class an exit search tries one byte of: the digits, the lower-case and the
    upper-case letters are a class each (a pattern's loop takes them alike); any other byte
    is a class of its own (the `@` of an email, the `.` of its domain)."""
    for first, last in (b"09", b"az", b"AZ"):
        if first <= byte <= last:
            return first
    return byte


@dataclass
class _Exits:
    """A walk's exit searches: how many it made, and the loops it found no way out of (by
    `_Exit.key`), which it does not search again."""

    searches: int = 0
    failed: set[tuple[frozenset[int], tuple[int, ...]]] = field(default_factory=set)

    def find(self, walker: Any, walk: ClosingWalk, order: list[int]) -> list[int]:
        """The tokens of the way out of the lexeme `walker` goes round in; [] if none is near."""
        if self.searches >= _EXIT_SEARCHES:
            return []
        search = _Exit(walker, walk, order)
        if search.key in self.failed:
            return []
        self.searches += 1
        found = search.closing() or search.leaving()
        if found is None:
            self.failed.add(search.key)
        return found or []


class _Exit:
    """The way out of a lexeme a walk goes round in, searched from `walker`'s state (and left
    as it was): `steps`, one allowed byte of each class (`_byte_class`, the first in the walk's
    order; printable ASCII, `_NOT_STEPS` aside), `shut`, the closing bytes not allowed there.

    `closing`: the shortest path of steps, up to `_EXIT_DEPTH`, after which a shut closing byte
    is allowed, and that byte (an email's domain, from `a@b0000`: `.aa"` where the pattern
    wants two letters after the dot). `leaving`: else a step after which the allowed steps and
    closing bytes differ from here, and still differ after each step more (the `@` of the
    local part; not its `.`, after which the next byte is the local part again)."""

    def __init__(self, walker: Any, walk: ClosingWalk, order: list[int]) -> None:
        self.walker, self.tries = walker, 0
        steps: dict[int, int] = {}
        for token in order:
            byte = walk.token_bytes[token][0]
            kind = _byte_class(byte)
            if 0x20 <= byte < 0x7F and byte not in _NOT_STEPS and kind not in steps:
                if walker.validate_tokens([token]):
                    steps[kind] = token
        self.steps = list(steps.values())
        self.shut = [t for t in walk.closers if not walker.validate_tokens([t])]
        self.key = (frozenset(steps), tuple(self.shut))  # the same loop met again

    def closing(self) -> list[int] | None:
        """Steps and a closing byte (tokens), fewest steps first; None if none within reach."""
        if not self.shut:
            return None
        for depth in range(1, _EXIT_DEPTH + 1):
            found = self._closing(depth)
            if found is not None or self.tries >= _EXIT_TRIES:
                return found
        return None

    def _closing(self, depth: int) -> list[int] | None:
        for token in self._allowed_steps():
            self.walker.consume_token(token)
            try:
                if depth > 1:
                    found = self._closing(depth - 1)
                    if found is not None:
                        return [token, *found]
                else:
                    closer = next((c for c in self.shut if self.walker.validate_tokens([c])), None)
                    if closer is not None:
                        return [token, closer]
            finally:
                self.walker.rollback(1)
        return None

    def _allowed_steps(self) -> list[int]:
        """The steps allowed here (each counted as a try; none past `_EXIT_TRIES`)."""
        found = []
        for token in self.steps:
            if self.tries >= _EXIT_TRIES:
                break
            if self.walker.validate_tokens([token]):
                self.tries += 1
                found.append(token)
        return found

    def leaving(self) -> list[int] | None:
        """A step (as a one-token list) that leaves this state for good; None if none does."""
        self.tries = 0
        home = self._signature()
        for token in self._allowed_steps():
            self.walker.consume_token(token)
            try:
                if self._signature() != home and self._stays_away(home):
                    return [token]
            finally:
                self.walker.rollback(1)
        return None

    def _stays_away(self, home: tuple[bool, ...]) -> bool:
        """Whether something is allowed here and no step leads back to `home`'s signature."""
        onward = any(self.walker.validate_tokens([t]) for t in self.shut)
        for token in self._allowed_steps():
            onward = True
            self.walker.consume_token(token)
            try:
                if self._signature() == home:
                    return False
            finally:
                self.walker.rollback(1)
        return onward

    def _signature(self) -> tuple[bool, ...]:
        """Which steps and shut closing bytes are allowed here."""
        return tuple(bool(self.walker.validate_tokens([t])) for t in self.steps + self.shut)
