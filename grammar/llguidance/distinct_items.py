"""`uniqueItems` beside llguidance: distinct array items (and distinct object keys), checked
on the document's text.

llguidance has no `uniqueItems` (a context-free grammar cannot say "no item twice"). Before
this, such an array was bounded to one item, so a user asking for a list of distinct tags got
at most one. Now the schema goes to llguidance without the keyword and each row checks the
JSON text it produces: when an array item's value is whole (see `DistinctItems`), its value, read
with `json.loads` and written canonically (object keys sorted; 1 and 1.0 the same number, as
JSON Schema compares them), must not equal an earlier item of the same array. A token that
would end a duplicate is refused by `advance` and cleared from the row's mask by `fill`, so
sampling never picks it.

The check applies to every array of the document, as the text does not say which schema node
an array belongs to (through anyOf, $ref, ...). Where the schema also allows arrays without
`uniqueItems`, those lose their duplicates too: `all_arrays_unique` says when, and the engine
notes it.

Object keys: llguidance lets the key of a pattern property repeat (`{"a":1,"a":2}`), and the
larger objects' optional properties become patterns (`order`), so those rows also
refuse a key its object has already (compared as written, quotes included). `fill` looks the
tokens to clear up rather than trying the mask: inside a key, those that begin with the rest
of an ended key and its closing quote (built once as each key ends, by the key's text so far);
and the tokens able to write a whole key at once (two quotes: 20 of SmolLM2's tokens), tried
only when an ended key is one they can write. Measured on the 225-schema sample (mask best of
5 walks): 17-19 us a step, against 18 us with the check off.

Cost: for items, `fill` tests only the tokens the grammar allows that could end an item here
(inside a string, those holding a `"`; elsewhere, those holding a `"`, `,`, `]` or `}`: `"ab"`
opens and ends a string at once), only inside an array, and while no open array has an ended
item yet, only those holding two such bytes (a repeat then needs two items ended by one token).
A probe shares the text with the row's state and cuts it back, so testing a token costs its own
bytes, not the document's.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantkit.grammar.verdict import Verdict, keeps
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = [
    "DistinctItems",
    "DistinctRow",
    "EndingTokens",
    "all_arrays_unique",
    "canonical",
    "set_bits",
]

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
# `EndingTokens.kinds` flags.
QUOTE, ENDS = 1, 2
_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")
_QUIET = frozenset(b": \t\r\n")
# The bytes at which `feed` can end an item or key (a quote inside a string; a `,`, `]` or `}`
# outside one): text without them ends none.
_ENDING = re.compile(rb'[",\]}]').search


def _normal(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def canonical(text: bytes) -> str:
    """The JSON value of `text`, written so that values JSON Schema calls equal are equal."""
    return json.dumps(_normal(json.loads(text)), sort_keys=True)


@dataclass
class _Frame:
    """An open container: where it began in the text; for an array, the items it has ended
    and where the item in progress began (None between items); for an object, the keys it
    has ended (as written, quotes included), where the key in progress began (None outside
    one) and whether the next string is a key."""

    start: int
    array: bool
    seen: set[str] = field(default_factory=set)
    item: int | None = None
    keys: set[bytes] = field(default_factory=set)
    key: int | None = None
    want_key: bool = False
    # For a key in progress whose text so far is T: the tokens that would end it as one of
    # `keys` (those beginning with the rest of that key), built as each key ends.
    endings: dict[bytes, tuple[int, ...]] = field(default_factory=dict)

    def copy(self) -> _Frame:
        """A copy sharing the sets (a probe replaces them rather than adding to them)."""
        return _Frame(self.start, self.array, self.seen, self.item, self.keys, self.key,
                      self.want_key, self.endings)  # fmt: skip


@dataclass
class DistinctItems:
    """The JSON text so far and its open containers: what a duplicate check needs.

    An item ends as soon as its value is whole: a string at its closing quote, an object or
    array at its closing bracket, a number or literal at the `,` or `]` after it (before that
    more digits could follow). So the token that would complete a duplicate is the one
    refused, while the value can still become another."""

    text: bytearray = field(default_factory=bytearray)
    stack: list[_Frame] = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    string_start: int = 0
    items: bool = True  # refuse a repeated array item
    keys: bool = False  # refuse a repeated object key
    # Keys some token can write whole (`EndingTokens.whole_names`), and how many of the open
    # objects' ended keys are among them (only then can a token outside the key repeat one).
    whole_names: frozenset[bytes] = frozenset()
    writable: int = 0
    # The tokens beginning with given bytes (`EndingTokens.starting_with`): None, no endings
    # are kept (a probe only checks, it does not mask).
    starting_with: Callable[[bytes], tuple[int, ...]] | None = None

    def first_repeat(self, pieces: list[bytes]) -> int | None:
        """The index of the first of `pieces` that, fed after the ones before it, would end a
        repeated item or key; None when none would. This state is left as it was: the probe shares
        its text (cut back afterwards) and copies only the open containers."""
        if not any(_ENDING(data) for data in pieces):
            return None  # no byte that ends anything (most tokens of a value)
        frames = [f.copy() for f in self.stack]
        probe = DistinctItems(self.text, frames, self.in_string, self.escaped, self.string_start,
                              self.items, self.keys, self.whole_names, self.writable)  # fmt: skip
        size = len(self.text)
        try:
            for i, data in enumerate(pieces):
                if not probe.feed(data, shared=True):
                    return i
            return None
        finally:
            del self.text[size:]

    def key_after(self, data: bytes) -> tuple[set[bytes], bytes, bool] | None:
        """Where `data` would leave a key of an object that has written keys: (those keys, as
        written with quotes; the new key's text so far; whether its opening quote is still to
        come, after a `,`). None when it leaves none (no object, one without keys, a value), or
        when `data` itself would end a repeat. This state is left as it was (as
        `first_repeat`: the probe shares the text, cut back afterwards)."""
        if _QUOTE not in data:  # told without a probe (a probe copies every open container)
            if self.in_string:
                if self.in_value_string():
                    return None  # inside a value's string, and still inside it after `data`
                # inside a key, and still inside it: its text so far is the text and `data`
                top = self.stack[-1]
                return (top.keys, bytes(self.text[top.key + 1 :]) + data, False) if (
                    top.keys) else None  # fmt: skip
            top = self.stack[-1] if self.stack else None
            if not _ENDING(data) and (top is None or top.array or not top.want_key):
                # no `,` to make a key wanted, no `"` to begin one, no bracket closed back to
                # another container: where no key is wanted now, none is after `data` (an
                # opening bracket begins a container without keys)
                return None
        return self._key_after_fed(data)

    def _key_after_fed(self, data: bytes) -> tuple[set[bytes], bytes, bool] | None:
        """`key_after` told by feeding `data` to a probe (what its shortcuts must agree with)."""
        frames = [f.copy() for f in self.stack]
        probe = DistinctItems(self.text, frames, self.in_string, self.escaped, self.string_start,
                              self.items, self.keys, self.whole_names, self.writable)  # fmt: skip
        size = len(self.text)
        try:
            if not probe.feed(data, shared=True):
                return None
            top = probe.stack[-1] if probe.stack else None
            if top is None or top.array or not top.keys:
                return None
            if probe.in_string and top.key == probe.string_start:
                return top.keys, bytes(probe.text[top.key + 1 :]), False
            if not probe.in_string and top.want_key:
                return top.keys, b"", True
            return None
        finally:
            del self.text[size:]

    def probe(self) -> DistinctItems:
        """A copy to walk ahead with: its own text and open containers, the seen items and
        keys shared (feed it with `shared=True`, which replaces them rather than adds)."""
        return DistinctItems(bytearray(self.text), [f.copy() for f in self.stack],
                             self.in_string, self.escaped, self.string_start, self.items,
                             self.keys, self.whole_names, self.writable)  # fmt: skip

    def in_value_string(self) -> bool:
        """Whether the text is inside a string that is not an object's key."""
        if not self.in_string:
            return False
        top = self.stack[-1] if self.stack else None
        return top is None or top.array or top.key != self.string_start

    @property
    def in_array(self) -> bool:
        """Whether an array is open (only then can an item end)."""
        return any(f.array for f in self.stack)

    @property
    def has_items(self) -> bool:
        """Whether some open array holds an ended item (else a repeat needs two items ended)."""
        return any(f.seen for f in self.stack)

    def repeating(self) -> tuple[int, ...]:
        """Inside a key: the tokens that would end it as a key its object has already."""
        top = self.stack[-1] if self.stack else None
        if not self.in_string or top is None or not top.endings or top.key != self.string_start:
            return ()
        return top.endings.get(bytes(self.text[self.string_start :]), ())

    def _end_key(self, top: _Frame, end: int, *, shared: bool) -> bool:
        """End `top`'s key in progress at text[:end]; False when the object has it already."""
        name = bytes(self.text[top.key : end])  # type: ignore[index]  # a key is in progress
        top.key = None
        if not self.keys:
            return True
        if name in top.keys:
            return False
        if name in self.whole_names:
            self.writable += 1
        if self.starting_with is not None:
            endings = top.endings
            for i in range(1, len(name)):
                found = self.starting_with(name[i:])
                if found:
                    endings[name[:i]] = endings.get(name[:i], ()) + found
        if shared:
            top.keys = top.keys | {name}
        else:
            top.keys.add(name)
        return True

    def _top_array(self) -> _Frame | None:
        top = self.stack[-1] if self.stack else None
        return top if top is not None and top.array else None

    def _begin_item(self, at: int) -> None:
        top = self._top_array()
        if top is not None and top.item is None:
            top.item = at

    def _end_item(self, top: _Frame, end: int, *, shared: bool) -> bool:
        """End `top`'s item in progress at text[:end]; False when it repeats an earlier one."""
        if top.item is None:
            return True
        if not self.items:
            top.item = None
            return True
        value = canonical(bytes(self.text[top.item : end]))
        if value in top.seen:
            return False
        if shared:
            top.seen = top.seen | {value}
        else:
            top.seen.add(value)
        top.item = None
        return True

    def _ends_item(self, began: int) -> _Frame | None:
        """The array whose item in progress is the value that began at `began`, if one is."""
        top = self._top_array()
        return top if top is not None and top.item == began else None

    def feed(self, data: bytes, *, shared: bool = False) -> bool:
        """Take `data`; False at the first byte that ends a duplicate item or key. shared: the
        sets of seen items and keys belong to another state (`first_repeat`'s probe), so they
        are replaced, not added to."""
        for byte in data:
            self.text.append(byte)
            end = len(self.text)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == _BACKSLASH:
                    self.escaped = True
                elif byte == _QUOTE:
                    self.in_string = False
                    top = self.stack[-1] if self.stack else None
                    if top is not None and not top.array and top.key == self.string_start:
                        if not self._end_key(top, end, shared=shared):
                            return False
                        continue
                    top = self._ends_item(self.string_start)
                    if top is not None and not self._end_item(top, end, shared=shared):
                        return False
            elif byte == _QUOTE:
                top = self.stack[-1] if self.stack else None
                if top is not None and not top.array and top.want_key:
                    top.key, top.want_key = end - 1, False
                else:
                    self._begin_item(end - 1)
                self.in_string, self.string_start = True, end - 1
            elif byte in _OPEN:
                self._begin_item(end - 1)
                array = byte == ord("[")
                self.stack.append(_Frame(end - 1, array, want_key=not array))
            elif byte in _CLOSE or byte == ord(","):
                top = self._top_array()
                if top is not None and not self._end_item(top, end - 1, shared=shared):
                    return False
                if byte == ord(",") and self.stack and not self.stack[-1].array:
                    self.stack[-1].want_key = True
                if byte in _CLOSE and self.stack:
                    closed = self.stack.pop()
                    if self.writable and closed.keys:
                        self.writable -= len(closed.keys & self.whole_names)
                    outer = self._ends_item(closed.start)
                    if outer is not None and not self._end_item(outer, end, shared=shared):
                        return False
            elif byte not in _QUIET:
                self._begin_item(end - 1)
        return True


class EndingTokens:
    """Per vocabulary, the tokens that could end an array item or an object key, as bitmask
    lines (the engines' layout, token i at bit i % 32 of word i // 32): `quote` those holding
    a `"` (inside a string), `any_end` those holding a `"`, `,`, `]` or `}` (outside one),
    `two_ends` those holding two or more of these bytes (able to end two items); the tokens
    able to write a whole key, by the key they would write (`whole_keys`: each text between
    two consecutive quotes of a token, quotes included; 20 of SmolLM2's 49152 tokens hold two
    quotes), and those that may but cannot be read so (a backslash too: `unclear`); and the
    tokens holding a `"` sorted by their bytes (`starting_with`)."""

    _cache: dict[str, EndingTokens] = {}

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        words = (vocabulary.size + 31) // 32
        self.quote, self.any_end, self.two_ends = (np.zeros(words, dtype=np.uint32)
                                                   for _ in range(3))  # fmt: skip
        for token, data in vocabulary.token_bytes.items():
            at, bit = token >> 5, np.uint32(1 << (token & 31))
            ends = sum(data.count(c) for c in b'",]}')
            if b'"' in data:
                self.quote[at] |= bit
            if ends:
                self.any_end[at] |= bit
            if ends >= 2:
                self.two_ends[at] |= bit
        self.token_bytes = vocabulary.token_bytes
        self.whole_keys: dict[bytes, list[int]] = {}
        self.unclear: list[int] = []
        for token, data in sorted(vocabulary.token_bytes.items()):
            at = [i for i, b in enumerate(data) if b == _QUOTE]
            if len(at) < 2:
                continue
            if _BACKSLASH in data:
                self.unclear.append(token)
                continue
            for i, j in zip(at, at[1:], strict=False):
                self.whole_keys.setdefault(data[i : j + 1], []).append(token)
        self.whole_names = frozenset(self.whole_keys)
        # `quote` and `any_end` as one byte a token (`QUOTE`, `ENDS`): a greedy step's checks
        # read one token's flags, a bytearray index against a numpy word's shift and mask.
        lines = np.stack([self.quote, self.any_end]).view(np.uint8)
        bits = np.unpackbits(lines, axis=1, bitorder="little")[:, : vocabulary.size]
        self.kinds = bytearray((bits[0] * QUOTE | bits[1] * ENDS).tobytes())
        quoted = sorted((d, t) for t, d in vocabulary.token_bytes.items() if b'"' in d)
        self._quoted, self._quoted_ids = [d for d, _ in quoted], [t for _, t in quoted]
        self._starting: dict[bytes, tuple[int, ...]] = {}

    def starting_with(self, prefix: bytes) -> tuple[int, ...]:
        """The tokens holding a `"` whose bytes begin with `prefix` (remembered: the same key
        endings are asked for at every step inside a key)."""
        found = self._starting.get(prefix)
        if found is None:
            at = bisect_left(self._quoted, prefix)
            end = at
            while end < len(self._quoted) and self._quoted[end].startswith(prefix):
                end += 1
            found = tuple(self._quoted_ids[at:end])
            if len(self._starting) >= 1 << 16:  # bounded: a long-running server asks forever
                self._starting.clear()
            self._starting[prefix] = found
        return found

    @classmethod
    def of(cls, vocabulary: TokenVocabulary) -> EndingTokens:
        found = cls._cache.get(vocabulary.fingerprint)
        if found is None:
            found = cls._cache[vocabulary.fingerprint] = cls(vocabulary)
        return found


def set_bits(words: np.ndarray) -> np.ndarray:
    """The token ids whose bits are set in `words` (uint32 bitmask words)."""
    at = np.flatnonzero(words)
    if not at.size:
        return at
    bits = np.unpackbits(words[at].view(np.uint8), bitorder="little").reshape(-1, 32)
    rows, cols = np.nonzero(bits)
    return at[rows] * 32 + cols


class DistinctRow:
    """An llguidance row (`engine.LlgRow`) whose arrays hold distinct items (items) and
    whose objects hold distinct keys (keys)."""

    engine = "llguidance"

    def __init__(self, row: Any, ending: EndingTokens, *, items: bool = True,
                 keys: bool = False, runaway: Any = None) -> None:  # fmt: skip
        self.row, self.ending = row, ending
        # Steering out of a runaway number, string or nesting (`runaway.RunawayTokens`): its
        # `curb` at the end of every `fill`, its `rule` (whether `curb` would act) in `verdict`.
        self.runaway = runaway
        self.corners: Any = None  # `key_corners.KeyCorners`, set by the engine for JSON rows
        self.curbs: dict[str, int] = {}  # what `runaway.curb` reported doing, and how often
        self.state = DistinctItems(
            items=items,
            keys=keys,
            whole_names=ending.whole_names,
            starting_with=ending.starting_with if keys else None,
        )
        self.cleared = 0  # tokens the last `fill` took out as repeated items (a dead end's why)
        self.lenient = False  # the last `fill` let a repeated key through (see below)
        self.advanced = 0  # tokens advanced by: the state a verdict's runaway rule was read in
        self._curb: tuple[int, np.ndarray | None] = (-1, None)  # `_curbed`'s, for that state
        self._memo_at = -1  # `_corner_memo`'s state, and its answers
        self._memo: dict[int, bool] = {}

    def advance(self, token: int) -> bool:
        self.advanced += 1
        data = self.ending.token_bytes.get(int(token), b"")
        if self.lenient:  # the last fill let a repeated key through (a dead end otherwise)
            self.lenient = self.state.keys = False
            try:
                fed = self.state.feed(data)
            finally:
                self.state.keys = True
            return fed and self.row.advance(token)
        return self.state.feed(data) and self.row.advance(token)

    def fill(self, line: np.ndarray) -> None:
        self.row.fill(line)
        state, self.cleared, self.lenient = self.state, 0, False
        words = line.view(np.uint32)
        if state.keys and (state.in_string or state.writable or self.ending.unclear):
            self._clear_repeated_keys(words)
        if state.items and state.in_array:
            self._clear_repeated_items(words)
        if self.runaway is not None:
            rule = self.runaway.curb(state, words, finished=self.row.is_finished())
            if rule:
                self.curbs[rule] = self.curbs.get(rule, 0) + 1

    def verdict(self, token: int) -> Verdict:
        """Whether `fill` would leave `token` allowed here, told for this one token without
        computing the mask (`verdict.Verdict`): the grammar's own verdict; a token that ends a
        repeated key is refused (`fill` clears it, unless that leaves nothing); where a
        runaway rule curbs this state, a token it would take out is refused (wherever another
        token is allowed, that one survives the curb, so the curb acts and takes this one
        out), without asking the grammar; `ALLOWED` only where it ends no repeated key or
        item and the key-corner screen would keep it as the best token, `REFUSED` where the
        screen would clear it (it leads into a corner), and `UNKNOWN` where a repeat is in
        question otherwise. An `ALLOWED` token sets what `fill` sets (`cleared`,
        `lenient`), as `fill` would."""
        keep = self._curbed()
        if keep is not None and not keeps(keep, token):
            return Verdict.REFUSED
        row = self.row
        found = row.verdict(token)  # an allowed token is held by the matcher (`row.tried`)
        if found != Verdict.ALLOWED:
            return found
        found = self._checks(token)
        if found != Verdict.ALLOWED:
            row.untry()
            return found
        self.cleared, self.lenient = 0, False
        return Verdict.ALLOWED

    def _checks(self, token: int) -> Verdict:
        """`verdict`'s checks of the row's own on a token its grammar allows (and its matcher
        holds, tried): the repeated key or item, the key corners. Inside a string value, a
        token without a `"` stays inside it: it ends no key or item and begins no key (the most
        common step of a JSON output). A token that leads into a corner is `REFUSED`: the
        screen clears it wherever it is the best token allowed and another is allowed too,
        which a later `ALLOWED` token shows (`,"` after an object's last key with every key
        written: one of the demo schema's 42 steps, masked before)."""
        state = self.state
        kind = self.ending.kinds[token]
        if state.in_string and not kind & QUOTE and state.in_value_string():
            return Verdict.ALLOWED
        if state.keys and token in state.repeating():
            return Verdict.REFUSED
        if (
            kind & ENDS
            and (state.keys or state.items)
            and state.first_repeat([self.ending.token_bytes.get(token, b"")]) is not None
        ):
            return Verdict.UNKNOWN
        if self.corners is not None and not self.corners.clear_of(
            state,
            lambda: self.row.copy_after(token),
            token,
            self.row.holding(token),
            self._corner_memo(),
        ):
            return Verdict.REFUSED
        return Verdict.ALLOWED

    def _curbed(self) -> np.ndarray | None:
        """The tokens `fill`'s runaway curb would keep at most in this state (a mask line: all
        zero for the "again" rule, which leaves only an EOS), or None where it leaves the mask
        alone; read once a state. Complete is asked of the matcher before any held token (the
        "again" rule asks it at the top level only). A rule that keeps only tokens beginning
        with one byte (a looping string's closing quote, a repeating array's `]`) leaves the
        mask alone where it holds none of those (`_keeps_none`: a string held open by its
        pattern or minimum length, or a key whose closing quote would repeat a written one:
        150 of the 222 steps the string rule applied on the JSONSchemaBench `--per-category
        2` sample)."""
        if self.runaway is None:
            return None
        at, keep = self._curb
        if at == self.advanced:
            return keep
        found = self.runaway.rule(self.state, finished=lambda: self.row.is_finished())
        keep = None
        if found is not None:
            if found[1] is None:
                keep = self.runaway.nothing
            elif not self._keeps_none(found[1]):
                keep = found[1]
        self._curb = (self.advanced, keep)
        return keep

    def _keeps_none(self, keep: np.ndarray | None) -> bool:
        """Whether `fill` would keep none of a rule's `keep` tokens (its curb then leaves the
        mask alone), told where they all begin with one byte (`RunawayTokens.lead`): the
        grammar refuses that byte here, or the byte itself would end a repeated key or item,
        as then would every token beginning with it (`fill` clears those: the token a verdict
        asks about stays, so the clearing never empties the mask and lets them back)."""
        assert self.runaway is not None  # asked by `_curbed`
        lead = self.runaway.lead(keep)
        if lead is None:
            return False
        state = self.state
        if (state.keys or state.items) and state.first_repeat([bytes([lead])]) == 0:
            return True
        return not self.row.takes_byte(lead)

    def _clear_repeated_items(self, words: np.ndarray) -> None:
        state = self.state
        ends = self.ending.quote if state.in_string else self.ending.any_end
        if not state.has_items:
            ends = ends & self.ending.two_ends
        for token in set_bits(words & ends).tolist():
            if state.first_repeat([self.ending.token_bytes[token]]) == 0:
                words[token >> 5] &= ~np.uint32(1 << (token & 31))
                self.cleared += 1

    def screen(self, line: np.ndarray, scores: np.ndarray) -> list[int]:
        """Clear the model's best tokens that would lead a key into a corner (only a key its
        object has could end it), in `line` and in `scores` (the step's logits masked by
        `line`): `key_corners.KeyCorners.screen`, when this row has one; the tokens cleared."""
        if self.corners is None:
            return []
        return self.corners.screen(self.state, self.row.matcher, line, scores,
                                   self._corner_memo())  # fmt: skip

    def _corner_memo(self) -> dict[int, bool]:
        """The key-corner answers found in this state (by token), for `KeyCorners`."""
        if self._memo_at != self.advanced:
            self._memo_at, self._memo = self.advanced, {}
        return self._memo

    def closing_path(self, *, limit: int) -> tuple[bytes, bool]:
        """See `LlgRow.closing_path`; the walk writes no repeated key or item either (it
        feeds a copy of this row's text state as it goes)."""
        state = self.state

        def allows() -> Callable[[bytes], bool]:  # one probe per walk
            probe = state.probe()

            def check(data: bytes) -> bool:
                if probe.first_repeat([data]) is not None:
                    return False
                return probe.feed(data, shared=True)

            return check

        # The walk reads loops across the row's own text (`LlgRow` keeps its last bytes).
        return self.row.closing_path(limit=limit, allows=allows)

    def along(self, path: bytes) -> list[int]:
        """See `LlgRow.along`."""
        return self.row.along(path)

    def _clear_repeated_keys(self, words: np.ndarray) -> None:
        """Clear the tokens that would end a key its object has already: inside a key, the
        tokens that begin with the rest of an ended key and its closing quote; anywhere, the
        tokens that could write an ended key whole (both looked up, not tried over the mask;
        a token found is tried, and cleared if it is allowed and would repeat the key).

        A row can corner itself: in an object that allows only its declared keys, once it has
        written the text of a key it ended before (`{"city":"x","city`), only the closing
        quote can follow, and it would repeat the key. The grammar allows that prefix, and
        masking it would need a look-ahead through llguidance at every key. So when clearing
        would leave no token at all, the repeat is let through instead (the JSON still parses
        and validates: its last value counts) rather than stopping the row in a dead end."""
        state, ending = self.state, self.ending
        repeating = state.repeating()
        if not repeating and not state.writable and not ending.unclear:
            return
        view = memoryview(words)  # element access without numpy scalars: ~10x cheaper
        cleared = []
        for token in repeating:
            at, bit = token >> 5, 1 << (token & 31)
            if view[at] & bit:
                view[at] &= ~bit & 0xFFFFFFFF
                cleared.append(token)
        if state.writable or ending.unclear:
            found = list(ending.unclear)
            for frame in state.stack:
                if frame.keys:
                    for name in frame.keys & ending.whole_names:
                        found += ending.whole_keys[name]
            for token in found:
                at, bit = token >> 5, 1 << (token & 31)
                if view[at] & bit and state.first_repeat([ending.token_bytes[token]]) == 0:
                    view[at] &= ~bit & 0xFFFFFFFF
                    cleared.append(token)
        if cleared and not words.any():
            for token in cleared:
                view[token >> 5] |= 1 << (token & 31)
            self.lenient = True

    def is_finished(self) -> bool:
        return bool(self.row.is_finished())

    def forced_tokens(self) -> list[int]:
        """The grammar's forced tokens, up to the first that would end a duplicate item or
        key."""
        forced = self.row.forced_tokens()
        if not forced:  # most steps: nothing forced, nothing to check
            return forced
        stop = self.state.first_repeat([self.ending.token_bytes.get(t, b"") for t in forced])
        return forced if stop is None else forced[:stop]


def _may_hold_arrays(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if kinds is not None:
        return "array" in kinds
    return any(k in node for k in ("items", "prefixItems", "minItems", "maxItems", "contains"))


def all_arrays_unique(schema: Any) -> bool:
    """Whether every array the schema allows must hold distinct items anyway, so checking all
    of them narrows nothing: each node that may hold arrays says `uniqueItems: true`, and no
    object leaves its other properties' values free (additionalProperties absent or true)."""

    def walk(node: Any, key: str | None) -> bool:
        if isinstance(node, list):
            return all(walk(v, None) for v in node)
        if not isinstance(node, dict):
            return node is not True or key not in ("additionalProperties", "items")
        if _may_hold_arrays(node) and node.get("uniqueItems") is not True:
            return False
        declares = node.get("type") == "object" or "properties" in node
        if declares and node.get("additionalProperties", True) is True:
            return False
        return all(walk(v, k) for k, v in node.items()
                   if k not in ("enum", "const", "default", "examples"))  # fmt: skip

    return walk(schema, None)
