"""Steering a JSON row out of a runaway: a number that never ends, a string caught in a loop,
containers nested ever deeper.

A small model decoding greedily can stay inside what a schema leaves unbounded until the token
limit: `100000000000...`, `"BEFLUSK_BEFLUSK_BEFLUSK_...`, `{"a":{"a":{"a":...`. The grammar
allows every one of those tokens, so masking alone never ends them, and the budget steering
(`closing`) only rescues the document at the very end, after hundreds of tokens of noise.
`curb` takes out, from a row's mask, the tokens that would carry such a runaway on, whenever
the mask still allows something else (it only ever narrows a choice, never empties it, so a
schema that truly asks for a long number or deep nesting still gets it):

- a number (outside strings, the bytes `0-9 . e E + -` at the end of the text) of `MAX_NUMBER`
  bytes: tokens that begin with one of those bytes;
- a string whose last `REPEAT_BYTES` or more bytes are one piece of at most `MAX_PERIOD` bytes
  written three or more times over, or whose last `LONG_TOTAL` or more bytes are one piece of
  at most `LONG_PERIOD` bytes written twice or more (a sentence said again, word for word: the
  embedded model's "This is a JSON response to a request ... to the client.\n\n" over and over
  in an MCP schema's description): every token but those beginning with the closing quote;
- `MAX_DEPTH` containers open: tokens that open another (first byte past spaces `{` or `[`);
- a complete text that ends in the same piece twice (a tool call made a second time, word
  for word): every token, so that only the EOS is left;
- an array whose last items are one item over and over (four times or more, `ITEMS_TOTAL`
  bytes: `"data","data","data",...`), at the end of an item: every token but those that close
  the array.

The row's text and open containers come from the same tracker that checks distinct keys and
items (`distinct_items.DistinctItems`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from quantkit.grammar.llguidance.distinct_items import DistinctItems
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = [
    "MAX_DEPTH",
    "LONG_PERIOD",
    "LONG_TOTAL",
    "MAX_NUMBER",
    "REPEAT_BYTES",
    "RunawayTokens",
    "curb",
    "ends_twice",
    "repeats",
    "rule",
]

MAX_NUMBER = 16  # bytes: past int64's 19 digits nothing real is written in JSON anyway
MAX_DEPTH = 12
REPEAT_BYTES = 24
MAX_PERIOD = 32
# A longer piece (a sentence) written twice: 96 bytes in all, the piece up to 256 bytes.
LONG_TOTAL = 96
LONG_PERIOD = 256
# A complete text whose end is one piece written twice (a tool call made again), the piece
# AGAIN_LEAST to AGAIN_LONGEST bytes: it ends there.
AGAIN_LEAST = 16
AGAIN_LONGEST = 1024
# An array whose last items are one item written four times or more, 64 bytes in all.
ITEMS_TOTAL = 64
ITEMS_PERIOD = 64
_NUMBER = frozenset(b"0123456789.eE+-")


class RunawayTokens:
    """Per vocabulary, bitmask lines (uint32 words, token i at bit i % 32 of word i // 32) of
    the tokens that continue a number, that open a container, and that close a string."""

    _cache: dict[str, RunawayTokens] = {}

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        words = (vocabulary.size + 31) // 32
        self.number, self.opens, self.quote, self.close_array, self.last_quote = (
            np.zeros(words, dtype=np.uint32) for _ in range(5))  # fmt: skip
        for token, data in vocabulary.token_bytes.items():
            if not data:
                continue
            at, bit = token >> 5, np.uint32(1 << (token & 31))
            if data[0] in _NUMBER:
                self.number[at] |= bit
            if data.lstrip(b" \t\r\n")[:1] in (b"{", b"["):
                self.opens[at] |= bit
            if data[0] == ord('"'):
                self.quote[at] |= bit
                if b"," not in data:  # closes the string without opening another item
                    self.last_quote[at] |= bit
            if data[0] == ord("]"):
                self.close_array[at] |= bit
        self.not_number, self.not_opens = ~self.number, ~self.opens
        self.nothing = np.zeros(words, dtype=np.uint32)  # what the "again" rule keeps

    def curb(
        self, state: DistinctItems, words: np.ndarray, *, finished: bool = False
    ) -> str | None:
        """`curb` with these tokens: what a row's `fill` calls."""
        return curb(state, words, self, finished=finished)

    def rule(
        self, state: DistinctItems, *, finished: bool | Callable[[], bool] = False
    ) -> tuple[str, np.ndarray | None] | None:
        """`rule` with these tokens: whether a row's `fill` would curb anything here."""
        return rule(state, self, finished=finished)

    def lead(self, keep: np.ndarray | None) -> int | None:
        """The byte every token of a rule's `keep` line begins with (a string's closing quote,
        an array's `]`), or None where the kept tokens share none (the number and depth rules
        keep all but some)."""
        if keep is self.quote or keep is self.last_quote:
            return ord('"')
        if keep is self.close_array:
            return ord("]")
        return None

    @classmethod
    def of(cls, vocabulary: TokenVocabulary) -> RunawayTokens:
        found = cls._cache.get(vocabulary.fingerprint)
        if found is None:
            found = cls._cache[vocabulary.fingerprint] = cls(vocabulary)
        return found


def repeats(data: bytes | bytearray, *, least: int = 3, total: int = REPEAT_BYTES,
            longest: int = MAX_PERIOD) -> bool:  # fmt: skip
    """Whether `data` ends in one piece of at most `longest` bytes written over and over: at
    least `least` times, and `total` bytes in all.

    Periods are tried shortest first, up to the first whose span the data cannot hold. Only a
    period whose byte a period before the last equals the last byte can repeat, so those are
    found by searching the data for the last byte (`rfind`) rather than by trying every period
    (the runaway rule asks on every step inside a string, the walks at every byte)."""
    size = len(data)
    periods = _periods(least, total, longest)
    bound = _first_too_long(least, total, longest, size)  # periods below it fit the data
    if bound <= 1:
        return False
    if least <= 1 and max(total, 1) < bound:  # a period of `total` bytes or more is written
        return True  # once, which any data ending in it does
    last = data[size - 1]
    at = data.rfind(last, max(0, size - bound), size - 1)
    while at >= 0:  # ascending periods: the nearest earlier copy of the last byte first
        period = size - 1 - at
        _, span, times = periods[period - 1]
        if data[size - span :] == data[size - period :] * times:
            return True
        at = data.rfind(last, max(0, size - bound), at)
    return False


@functools.cache
def _periods(least: int, total: int, longest: int) -> tuple[tuple[int, int, int], ...]:
    """(period, bytes spanned, times) for each period `repeats` tries, shortest first (the
    walks ask every byte: made once per setting)."""
    found = []
    for period in range(1, longest + 1):
        times = max(least, -(-total // period))
        found.append((period, times * period, times))
    return tuple(found)


@functools.lru_cache(maxsize=4096)  # per setting and data size
def _first_too_long(least: int, total: int, longest: int, size: int) -> int:
    """The shortest period (of `_periods`, in their order) whose span exceeds `size` bytes;
    longest + 1 if every one fits."""
    for period, span, _ in _periods(least, total, longest):
        if span > size:
            return period
    return longest + 1


def ends_twice(data: bytes | bytearray) -> bool:
    """Whether `data` ends in one piece of AGAIN_LEAST to AGAIN_LONGEST bytes written twice,
    whitespace between the two (and after the second) aside."""
    tail = bytes(data).rstrip()
    for size in range(AGAIN_LEAST, min(AGAIN_LONGEST, len(tail) // 2) + 1):
        if tail[:-size].rstrip().endswith(tail[-size:]):
            return True
    return False


def _number_tail(text: bytearray) -> int:
    """How many of the text's last bytes are a number's (up to MAX_NUMBER)."""
    count = 0
    for byte in reversed(text[-MAX_NUMBER:]):
        if byte not in _NUMBER:
            break
        count += 1
    return count


def _items_repeat(state: DistinctItems) -> bool:
    """Whether the innermost open container is an array whose text ends in one item written
    four times or more."""
    if not state.stack or not state.stack[-1].array:
        return False
    tail = state.text[-ITEMS_TOTAL * 3 :]
    return repeats(tail, least=4, total=ITEMS_TOTAL, longest=ITEMS_PERIOD)


def _said_again(state: DistinctItems) -> bool:
    """Inside a string: whether its text ends in one piece of at most LONG_PERIOD bytes written
    twice or more, LONG_TOTAL bytes in all."""
    start = max(state.string_start + 1, len(state.text) - 2 * LONG_PERIOD)
    body = state.text[start:]
    return len(body) >= LONG_TOTAL and repeats(
        body, least=2, total=LONG_TOTAL, longest=LONG_PERIOD)  # fmt: skip


def _string_item_again(state: DistinctItems) -> bool:
    """Inside a string item of an array: whether its text so far is the whole of the item
    before it, and the array's items repeat (so closing this string ends one more repeat)."""
    start = state.string_start
    if start < 2 or state.text[start - 1 : start] != b"," or state.text[start - 2] != ord('"'):
        return False
    before = state.text.rfind(b'"', 0, start - 2)
    current = state.text[start + 1 :]
    return bool(current) and state.text[before + 1 : start - 2] == current and _items_repeat(
        state)  # fmt: skip


def curb(
    state: DistinctItems, words: np.ndarray, tokens: RunawayTokens, *, finished: bool = False
) -> str | None:
    """Take a runaway's tokens out of `words` (a row's mask) where something else is left;
    the rule applied ("string", "number", "items", "depth", "again"), or None. finished: the
    grammar is complete here (then "again" may take every token out: the row ends)."""
    found = rule(state, tokens, finished=finished)
    if found is None:
        return None
    name, keep = found
    if keep is None:
        words[:] = 0
        return name
    kept = words & keep
    if not kept.any():
        return None
    words[:] = kept
    return name


def rule(
    state: DistinctItems, tokens: RunawayTokens, *, finished: bool | Callable[[], bool] = False
) -> tuple[str, np.ndarray | None] | None:
    """The runaway rule that applies to the row's text here and the tokens it keeps (a mask
    line; None: none, the row ends), or None where no rule applies (see `curb`). finished may
    be a function, asked only at the top level (outside every container and string)."""
    top = not state.stack and not state.in_string
    if top and (finished() if callable(finished) else finished):
        if ends_twice(state.text[-2 * AGAIN_LONGEST - 8 :]):
            return "again", None
        return None
    if state.in_string:
        if state.escaped:
            return None
        start = max(state.string_start + 1, len(state.text) - REPEAT_BYTES * 3 - MAX_PERIOD)
        if (len(state.text) - start >= REPEAT_BYTES and repeats(state.text[start:])) or (
            _said_again(state)
        ):
            return "string", tokens.quote
        if _string_item_again(state):  # the same item again: end it, then the array
            return "items", tokens.last_quote
        return None
    if _number_tail(state.text) >= MAX_NUMBER:
        return "number", tokens.not_number
    if state.text[-1:] != b"," and _items_repeat(state):
        return "items", tokens.close_array
    if len(state.stack) >= MAX_DEPTH:
        return "depth", tokens.not_opens
    return None
