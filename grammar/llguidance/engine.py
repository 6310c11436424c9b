"""The llguidance engine: JSON schemas, regexes and Lark grammars (context-free, the one kind
outlines-core cannot take; see `lark`) compiled natively, masks from an Earley parser over a
lazy lexer.

Where outlines-core turns a schema into one regex and walks the whole vocabulary through its
automaton up front (0.28 s p50, minutes for some schemas), llguidance builds its lexer lazily
and computes each step's mask from a token trie: compiles take milliseconds and the grammar is
the schema itself, so nothing is narrowed (no bounds on arrays, objects or property order).
What it cannot represent exactly it refuses, naming the keyword ("Unimplemented keys:
["uniqueItems"]"); `lenient` stays off, so it never ignores a keyword silently.

JSON comes out compact: no whitespace between tokens (`whitespace_flexible: False`), so the
whitespace bound is zero (outlines-core's lowering allows one optional space). Compact output
also makes more of each document forced (`{"name":"` after `{`), which fast-forward feeds
without sampling (`compute_ff_tokens`: llguidance's own safe fast-forward, canonical tokens
only, holding back a last token that the next bytes could still merge into).

The tokenizer: llguidance's `LLTokenizer` is built from the same `TokenVocabulary` the other
engine uses (same ids, same bytes, so both fill the same bitmask), with the model tokenizer's
own encoder for canonical tokenization; ~0.3 s for a 49k vocabulary, built once per vocabulary.

The build runs on a thread with a 1 GiB stack (`BUILD_STACK_BYTES`, address space mapped only
as it is touched): llguidance recurses once per rule of a chain of rules (r0 -> r1 -> ...,
~3 KB a level), and 3000 chained rules overflowed a thread's default stack, a segmentation
fault; on 1 GiB llguidance checked a 150000-rule chain (27 s, 2-core AMD EPYC) and refused a
200000-rule one in one line, at its own size limit (500000 symbols), before the stack's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantkit.errors import GrammarError, MissingExtraError
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.llguidance.closing import ClosingWalk
from quantkit.grammar.llguidance.distinct_items import DistinctRow, EndingTokens
from quantkit.grammar.llguidance.key_corners import KeyCorners
from quantkit.grammar.llguidance.order import Orders, any_order
from quantkit.grammar.llguidance.runaway import RunawayTokens
from quantkit.grammar.llguidance.schema import (
    llguidance_schema,
    one_of_exclusive,
    unique_items_listed,
    without_dependencies,
)
from quantkit.grammar.llguidance.warm import json_name, property_names, warm_keys
from quantkit.grammar.narrowing import ordered_objects
from quantkit.grammar.native_threads import run_with_limit
from quantkit.grammar.verdict import Verdict, keeps
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = [
    "BUILD_STACK_BYTES",
    "LlgIndex",
    "LlgRow",
    "compile_llguidance",
    "error_line",
    "import_llguidance",
    "llg_tokenizer",
]

# The compile's walk from the start state (`LlgIndex.start_walk`) stops at this many bytes
# (and `HEADROOM` more): a row's first walk is this one where its token budget allows no more
# (a 512-token budget walks up to 592 bytes).
START_WALK = 1024
# A walk goes this many bytes past the limit asked (`LlgRow.closing_path`), so that a row that
# follows a path too long for its budget takes its rest for the next steps.
HEADROOM = 256

# See the module docstring: deep enough that llguidance's size limit comes before the stack's.
BUILD_STACK_BYTES = 1 << 30

# Compact JSON: see the module docstring. coerce_one_of stays off: treating oneOf as anyOf
# would accept instances matching two branches (unsound); lenient off: no ignored keywords.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "coerce_one_of": False}

_tokenizers: dict[str, Any] = {}


def import_llguidance() -> Any:
    """llguidance, or a MissingExtraError naming the `grammar` extra."""
    try:
        import llguidance
    except ImportError as e:
        raise MissingExtraError("llguidance", "grammar") from e
    return llguidance


def _greedy_encoder(vocabulary: TokenVocabulary) -> Any:
    """Longest match over the vocabulary's bytes (hand-built vocabularies have no encoder)."""
    by_bytes = {data: token for token, data in sorted(vocabulary.token_bytes.items())}
    longest = max((len(d) for d in by_bytes), default=1)

    def encode(data: bytes) -> list[int]:
        out, at = [], 0
        while at < len(data):
            for size in range(min(longest, len(data) - at), 0, -1):
                token = by_bytes.get(data[at : at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
            else:  # a byte no token holds: llguidance falls back to its own greedy pass
                return out
        return out

    return encode


class _Wrapped:
    """The object `TokenizerWrapper` reads: bytes per id, EOS, special ids, encoder."""

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        self.eos_token_id = vocabulary.outlines_eos
        self.bos_token_id = None
        # Ids without bytes (special tokens, padding) get a unique name and are marked special,
        # so no grammar ever allows them as text.
        self.tokens = [
            vocabulary.token_bytes.get(i, b"<|qk-special-%d|>" % i) for i in range(vocabulary.size)
        ]
        self.special_token_ids = [
            i for i in range(vocabulary.size) if i not in vocabulary.token_bytes
        ]
        self._encode = vocabulary.encode or _greedy_encoder(vocabulary)

    def __call__(self, data: bytes) -> list[int]:
        return self._encode(data)


def llg_tokenizer(vocabulary: TokenVocabulary) -> Any:
    """The `LLTokenizer` of `vocabulary` (cached per fingerprint for the process's life)."""
    tokenizer = _tokenizers.get(vocabulary.fingerprint)
    if tokenizer is None:
        llg = import_llguidance()
        wrapped = llg.TokenizerWrapper(_Wrapped(vocabulary))
        eos = sorted(vocabulary.eos_token_ids)
        tokenizer = llg.LLTokenizer(wrapped, n_vocab=vocabulary.size, eos_token=eos)
        _tokenizers[vocabulary.fingerprint] = tokenizer
    return tokenizer


@dataclass(frozen=True)
class LlgIndex:
    """What an llguidance row needs: the tokenizer and the grammar text (LLMatcher's input).
    notes: llguidance's warnings about the grammar (none narrow it; shown to the user).

    Rows are copies of one matcher that never advances (`template`), not new matchers: the
    copies share the lexer states llguidance builds lazily while it computes masks, so every
    row after the first finds them built. Measured on 50519 mask steps of the JSONSchemaBench
    sample (SmolLM2 tokenizer, 2-core Xeon), the third walk of each instance: mean 33.1 us with
    a new matcher per row, 19.3 us with copies (first walk: 36.1 vs 26.8)."""

    tokenizer: Any
    grammar_text: str
    template: Any = field(compare=False, repr=False)  # built by the compile, never advanced
    notes: tuple[str, ...] = ()
    distinct: EndingTokens | None = None  # set: rows check distinct items and/or keys
    items: bool = False  # rows refuse a repeated array item (uniqueItems dropped)
    keys: bool = False  # rows refuse a repeated object key (every JSON schema)
    walk: ClosingWalk | None = field(default=None, compare=False, repr=False)
    runaway: RunawayTokens | None = field(default=None, compare=False, repr=False)
    corners: KeyCorners | None = field(default=None, compare=False, repr=False)
    # The finishing walk from the start, made by the compile (`compile_llguidance`) up to
    # `START_WALK` bytes: (path, complete). Every row begins in the same state, so every row's
    # first walk is this one (~3 ms on person.json, a third of a short document's grammar time
    # when made in the first step). None where it found no way (a loop); then by limit, as
    # rows walk: `first_walks`.
    start_walk: tuple[bytes, bool] | None = None
    first_walks: dict[int, tuple[bytes, bool]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # The mask of the start state, made by the compile (`LlgRow.fill` copies it into a row's
    # first step instead of asking the matcher: ~80 us cold inside `generate`).
    start_mask: np.ndarray | None = field(default=None, compare=False, repr=False)

    def new_row(self) -> LlgRow | DistinctRow:
        assert self.walk is not None  # set by compile_llguidance
        start = None
        if self.start_walk is not None:
            start = (*self.start_walk, self.distinct is not None)
        row = LlgRow(self.template.deep_copy(), self.walk, first_walks=self.first_walks,
                     start_walk=start, start_mask=self.start_mask)  # fmt: skip
        if self.distinct is None:
            return row
        distinct = DistinctRow(row, self.distinct, items=self.items, keys=self.keys,
                               runaway=self.runaway)  # fmt: skip
        distinct.corners = self.corners
        return distinct


# The row's text a walk reads its loops in (`closing.ClosingWalk.path`'s tail; its loop checks
# read at most 384 bytes).
_TAIL = 384
# First walks kept per grammar (one per token limit a request asked for).
_FIRST_WALKS = 64


class LlgRow:
    """One sequence's llguidance matcher behind the row interface the processor drives."""

    engine = "llguidance"

    def __init__(
        self,
        matcher: Any,
        walk: ClosingWalk,
        *,
        first_walks: dict[int, tuple[bytes, bool]] | None = None,
        start_walk: tuple[bytes, bool, bool] | None = None,
        start_mask: np.ndarray | None = None,
    ) -> None:
        self._matcher, self.walk = matcher, walk
        # The start state's mask (`LlgIndex.start_mask`) until the row first advances.
        self._start_mask = start_mask
        # A greedy step's verdict consumes its token (`verdict`): `tried` is that token until
        # the row is advanced by it (kept) or anything else reads the matcher (rolled back).
        self.tried: int | None = None
        # The bytes the grammar forces from the matcher's state, once asked (None: not asked
        # since the state last changed): a verdict needs them, and a step's `forced_tokens`
        # asked them already in the same state.
        self._ff: bytes | None = None
        # The tokens the grammar forces from here, once asked (None: not asked since the state
        # last changed): `forced_tokens` returns them, and where there are none `verdict`
        # allows a token writing the first forced bytes.
        self._ff_tokens: list[int] | None = None
        self.text = bytearray()  # the row's last bytes (at least `_TAIL`): a walk's tail
        self.written = 0  # bytes advanced by, in all
        # Walks from the start state, shared by the rows of one grammar; None once advanced.
        self.first_walks = first_walks
        # The last walk kept: its path, `written` when it was made, whether it was made with
        # a check of the row's own (`closing_path`'s allows) and whether it is complete
        # (`_kept`). start_walk: the compile's walk from the start state (path, complete,
        # checked), or None.
        self.last_walk: tuple[bytes, int, bool, bool] | None = None
        if start_walk is not None:
            self.last_walk = (start_walk[0], 0, start_walk[2], start_walk[1])
        if matcher.is_error():
            raise GrammarError(f"llguidance: {matcher.get_error()}")

    @property
    def matcher(self) -> Any:
        """The llguidance matcher, advanced by exactly the tokens the row was (a token a
        verdict tried is rolled back first)."""
        if self.tried is not None:
            self.untry()
        return self._matcher

    def untry(self) -> None:
        """Roll back the token the last verdict consumed, if it is still held."""
        if self.tried is not None:
            self.tried = None
            self._matcher.rollback(1)

    def advance(self, token: int) -> bool:
        if self.tried is not None and self.tried == int(token):
            self.tried = None  # the verdict consumed it already
        elif not self.matcher.consume_token(int(token)):
            return False
        self._ff, self._ff_tokens = None, None
        self.first_walks = None  # no longer in the start state
        self._start_mask = None
        data = self.walk.token_bytes.get(int(token), b"")
        self.text += data
        self.written += len(data)
        if len(self.text) > 2 * _TAIL:
            del self.text[:-_TAIL]
        return True

    def fill(self, line: np.ndarray) -> None:
        start = self._start_mask
        if start is not None and line.shape == start.shape:
            self.untry()  # as `matcher` would: the mask is the row's own state's
            line[:] = start  # the start state's, made by the compile
            return
        self.matcher.unsafe_compute_mask_ptr(line.ctypes.data, line.nbytes)

    def verdict(self, token: int) -> Verdict:
        """Whether `fill`'s mask keeps `token` here (not asked of an EOS, which the processor
        allows by completion), told without the mask: the matcher tries it, and holds an
        allowed token (`tried`) until the row is advanced by it or read otherwise. In the
        start state the mask is known (the compile's, `start_mask`): its bit tells.

        Where the grammar forces bytes, llguidance's mask keeps the allowed tokens that begin
        with all of them. Of the tokens that write only their first bytes (`":` with `":"`
        forced after a key), its mask keeps all where it forces no token (it then masks with
        the forced bytes as the prefix, and every token that is a prefix of them is allowed),
        and where it forces tokens only the first of those: so such a token is `ALLOWED`
        where llguidance forces no token in this state (asked once a state, if
        `forced_tokens` has not), else `UNKNOWN` (`{` against a forced `{"` at the start of a
        document, where the mask keeps `{"` alone).
        Checked against the mask over SmolLM2's vocabulary along 30 JSONSchemaBench outputs:
        at their 545 forced states every allowed token beginning with the forced bytes had its
        bit; along random walks through the JSONSchemaBench sample's schemas (8 a category,
        3 seeds), all 2463 tokens writing the first bytes of forced ones where no token was
        forced had their bit; at 607 other states of 12 outputs the matcher and the mask
        agreed on every token."""
        token = int(token)
        start = self._start_mask
        if start is not None:  # the start state: its mask is the compile's
            self.untry()
            if not keeps(start, token):
                return Verdict.REFUSED
            if self._matcher.try_consume_tokens([token]) != 1:
                return Verdict.UNKNOWN  # never seen: the mask decides
            self.tried = token
            return Verdict.ALLOWED
        matcher = self.matcher
        forced = self._forced_bytes()
        data = self.walk.token_bytes.get(token, b"")
        head = bool(forced) and not data.startswith(forced) and forced.startswith(data)
        head = head and not self._forced_token_list()  # asked before the token is tried
        # One llguidance call tells and takes the token (a greedy step's pick is the first
        # token allowed, and the row is advanced by it next): held in `tried`, rolled back
        # where the row is advanced otherwise or read before.
        if matcher.try_consume_tokens([token]) != 1:
            return Verdict.REFUSED
        if not forced or data.startswith(forced) or head:
            self.tried = token
            return Verdict.ALLOWED
        matcher.rollback(1)
        return Verdict.UNKNOWN

    def is_finished(self) -> bool:
        return bool(self.matcher.is_accepting())

    def takes_byte(self, byte: int) -> bool:
        """Whether the matcher, before any token a verdict holds, takes `byte` next (its
        one-byte token; True where the vocabulary has none). Where it refuses the byte, it
        refuses every token beginning with it, so no mask keeps one."""
        token = self.walk.byte_token.get(byte)
        if token is None:
            return True
        matcher, held = self._matcher, self.tried
        if held is not None:
            matcher.rollback(1)
        try:
            return matcher.validate_tokens([token]) == 1
        finally:
            if held is not None and not matcher.consume_token(held):
                raise AssertionError(f"llguidance refused token {held} again")

    def holding(self, token: int) -> Any:
        """The matcher itself where the last verdict tried `token` and holds it, else None:
        for a look-ahead that leaves it as it found it (`key_corners.KeyCorners._quick`)."""
        return self._matcher if self.tried is not None and self.tried == token else None

    def copy_after(self, token: int) -> Any:
        """A copy of the matcher advanced by `token` (None where it refuses it); the held
        one where the last verdict tried that token."""
        if self.tried is not None and self.tried == token:
            return self._matcher.deep_copy()
        copy = self.matcher.deep_copy()
        return copy if copy.consume_token(int(token)) else None

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (canonical, safe to append without sampling).
        Where it forces no byte, none, without asking for tokens (a few us against ~10)."""
        if not self._forced_bytes():
            return []
        return list(self._forced_token_list())

    def _forced_token_list(self) -> list[int]:
        """llguidance's forced tokens from here (asked once a state: `_ff_tokens`)."""
        if self._ff_tokens is None:
            self._ff_tokens = list(self.matcher.compute_ff_tokens())
        return self._ff_tokens

    def _forced_bytes(self) -> bytes:
        """The bytes the grammar forces from here (asked once a state: `_ff`)."""
        if self._ff is None:
            self._ff = bytes(self.matcher.compute_ff_bytes())
        return self._ff

    def closing_path(
        self,
        *,
        limit: int,
        allows: Callable[[], Callable[[bytes], bool]] | None = None,
    ) -> tuple[bytes, bool]:
        """A way to complete the document from here, in bytes, and whether it is complete
        (`closing.ClosingWalk.path`, on a copy of the matcher, reading loops across the row's
        own last bytes): `limit` bytes of it where it is longer. A walk goes `HEADROOM` bytes
        further than asked and is kept (`last_walk`): where the row has written only its
        first bytes since (it followed the path: budget steering allows nothing else), the
        rest of it is the answer, without a walk (`_kept`); a row that cannot finish in its
        budget walks once every hundred tokens or so instead of at every step."""
        checked = allows is not None
        kept = self._kept(limit, checked=checked)
        if kept is not None:
            return kept
        if self.first_walks is not None and limit in self.first_walks:
            return self.first_walks[limit]
        tail = bytes(self.text[-_TAIL:])
        reach = limit + HEADROOM
        path, complete = self.walk.path(self.matcher, limit=reach, allows=allows, tail=tail)
        found = (path[: limit - 1], False)  # no way on (a loop): shorter than asked, not kept
        if complete or len(path) == reach:  # complete, or longer than the walk went
            self.last_walk = (path, self.written, checked, complete)
            found = self._kept(limit, checked=checked) or found
        if self.first_walks is not None:
            if len(self.first_walks) >= _FIRST_WALKS:
                self.first_walks.clear()
            self.first_walks[limit] = found
        return found

    def _kept(self, limit: int, *, checked: bool) -> tuple[bytes, bool] | None:
        """The answer `closing_path` takes from the kept walk (made with the same kind of
        check), where the row's bytes since it are its path's first bytes: the rest (b""
        where the document is complete now, as a walk from here would find), complete if the
        walk was and the rest is shorter than `limit`, else its first `limit` bytes; None
        where there is no such walk or the rest would be shorter than `limit` and not
        complete."""
        if self.last_walk is None or self.last_walk[2] != checked:
            return None
        if self.matcher.is_accepting():
            return b"", True
        path, at, _, complete = self.last_walk
        size = self.written - at
        if size > len(path) or size > len(self.text):
            return None
        if size and self.text[len(self.text) - size :] != path[:size]:
            return None
        rest = path[size:]
        if complete and len(rest) < limit:
            return rest, True
        if len(rest) >= limit:
            return rest[:limit], False
        return None

    def along(self, path: bytes) -> list[int]:
        """The tokens that follow `path` (`closing.ClosingWalk.along`)."""
        return self.walk.along(path)


def error_line(messages: list[str]) -> str:
    """llguidance's first message as one line: "at 2(8): duplicate rule" (line 2, column 8,
    then the grammar's lines quoted below) becomes "line 2 column 8: duplicate rule", and a
    detail it puts on a later line ("error: unclosed group" of a bad regex) is kept."""
    lines = (messages[0] if messages else "").strip().splitlines() or ["unknown error"]
    first = re.sub(r"^(?:at )?(\d+)\((\d+)\): ", r"line \1 column \2: ", lines[0].strip())
    details = [ln.strip()[len("error:") :].strip() for ln in lines[1:]
               if ln.strip().startswith("error:")]  # fmt: skip
    return "; ".join([first.rstrip(": "), *details])


def _grammar_text(grammar: Grammar, schema: Any, options: dict[str, Any]) -> str:
    llg = import_llguidance()
    if grammar.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    if grammar.kind == "lark":
        assert grammar.lark is not None  # lark grammars always carry their text
        return llg.LLMatcher.grammar_from_lark(grammar.lark)
    assert grammar.regex is not None  # regex and choice grammars always carry theirs
    return llg.LLMatcher.grammar_from_regex(grammar.regex)


def _build(grammar: Grammar, tokenizer: Any) -> tuple[bool, list[str], str, list[str], Any]:
    """(is_error, llguidance's messages, grammar text, notes, (the template matcher, (whether
    rows must check distinct array items, distinct object keys))), settling what `schema`
    can:
    `not`, `if`/`then`/`else` and overlapping `oneOf`s in positive keywords (exact, or narrower
    and noted); a oneOf proven exclusive is read as anyOf (exact); dependency keywords are
    rewritten into a narrower schema (noted); uniqueItems is listed exactly or left to the
    rows' check (`distinct_items`); objects take their keys in any
    order where `order.any_order` can afford it (exact), and the rest are noted."""
    llg = import_llguidance()
    # Exact rewrites, then the narrowed ones for `not`, `if` and overlapping `oneOf` (noted).
    schema, notes = llguidance_schema(grammar.schema)
    options = dict(JSON_OPTIONS)
    done: set[Any] = set()  # the narrowing rewrites applied (each once)
    distinct = False  # uniqueItems dropped: the rows check distinct items
    orders = Orders()
    reorder = grammar.kind == "json_schema"  # off again if the copies make it too large
    template = None
    patterns = True  # larger objects' optional keys as patterns (off if they overlap others)
    reordered: tuple[Any, Any] = ((None, None), None)  # ((schema, patterns), any_order of it)
    for _ in range(16):  # each retry settles one refusal
        if reorder:  # keys in any order (exact), where it can afford the copies
            if reordered[0][0] is not schema or reordered[0][1] != patterns:
                reordered = ((schema, patterns), any_order(schema, patterns=patterns))
            written, orders = reordered[1]
            text = _grammar_text(grammar, written, options)
        else:
            orders = Orders(ordered_objects(schema) if grammar.kind == "json_schema" else [])
            text = _grammar_text(grammar, schema, options)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if not is_error:  # built once here: some limits only the build finds (symbol count)
            template = llg.LLMatcher(tokenizer, text, log_level=0)
            if template.is_error():
                is_error, messages = True, [template.get_error()]
            else:  # the first mask builds the start state's lexer: here, not in the first step
                scratch = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
                template.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if not is_error or grammar.kind != "json_schema":
            break
        # A format a draft defines but llguidance lacks stays a refusal (`formats_written`):
        # dropping one accepted an instance invalid by it (MCPspec CompleteRequest).
        reason = messages[0] if messages else ""
        if reorder and ("too large" in reason or "symbols" in reason):
            reorder = False  # the schema as written, in declaration order (noted)
        elif reorder and patterns and "not disjoint" in reason:
            patterns = False  # a name as a pattern overlapped a pattern merged from elsewhere
        elif "oneOf" in reason and not options["coerce_one_of"] and one_of_exclusive(schema):
            options["coerce_one_of"] = True  # exact: the branches are pairwise disjoint
        elif "Unimplemented keys" in reason and "uniqueItems" in reason:
            if unique_items_listed in done:
                break
            done.add(unique_items_listed)
            schema, more, distinct = unique_items_listed(schema)
            notes += more
        elif "Unimplemented keys" in reason and "ependen" in reason:
            if without_dependencies in done:
                break
            done.add(without_dependencies)
            rewritten = without_dependencies(schema)
            if rewritten is None:
                break
            schema, more = rewritten
            notes += more
        else:
            break
    checks = (distinct, bool(orders.freed))
    return is_error, messages, text, notes + orders.notes(), (template, checks)


def compile_llguidance(
    grammar: Grammar,
    vocabulary: TokenVocabulary,
    *,
    timeout_s: float | None,
    limit_s: float | None = None,
) -> LlgIndex:
    """Check and build `grammar` for llguidance within `timeout_s`; GrammarError naming the
    keyword llguidance does not support, or the phase that ran out of time."""
    tokenizer = llg_tokenizer(vocabulary)
    # Native code that drops the GIL: a thread can wait on it, and is abandoned at the limit.
    # The start walk runs in the same thread: the limit bounds the compile's whole work.
    done, built = run_with_limit(
        lambda: _build_index(grammar, vocabulary, tokenizer), timeout_s,
        name="quantkit-llguidance-build", stack_bytes=BUILD_STACK_BYTES,
    )  # fmt: skip
    if not done:
        raise GrammarError(
            f"{grammar.label}: llguidance grammar build took longer than the limit of "
            f"{limit_s or timeout_s:g} s (--compile-timeout; phase: llguidance build)"
        )
    messages, index = built
    if index is None:
        if grammar.kind == "lark":  # positions and details matter to whoever wrote the grammar
            reason = error_line(messages)
        else:
            reason = (messages[0] if messages else "unknown error").splitlines()[0]
        raise GrammarError(f"{grammar.label}: llguidance cannot compile it: {reason}")
    return index


def _build_index(
    grammar: Grammar, vocabulary: TokenVocabulary, tokenizer: Any
) -> tuple[list[str], LlgIndex | None]:
    """The build's messages and the grammar's index with its walk from the start state made
    (None where llguidance refused the grammar)."""
    is_error, messages, text, notes, (template, (items, keys)) = _build(grammar, tokenizer)
    if is_error:
        return messages, None
    notes += [f"llguidance: {m}" for m in messages]
    # Every JSON document's objects hold distinct keys, whatever wrote them (declared names
    # made patterns, patternProperties, additionalProperties: llguidance lets those repeat),
    # and its rows are steered out of runaways (`runaway`).
    json_text = grammar.kind == "json_schema" or grammar.json_text
    keys = keys or json_text
    ending = EndingTokens.of(vocabulary) if items or keys else None
    index = LlgIndex(tokenizer, text, template, tuple(notes), ending, items=items, keys=keys,
                     walk=ClosingWalk.of(vocabulary),
                     runaway=RunawayTokens.of(vocabulary) if json_text else None,
                     corners=KeyCorners.of(vocabulary) if keys else None)  # fmt: skip
    if grammar.kind == "json_schema":  # its keys' forced texts, tokenized ahead (`warm`)
        warm_keys(grammar.schema, vocabulary.encode)
        if index.corners is not None:
            index = dataclasses.replace(
                index,
                corners=index.corners.with_names(
                    json_name(n).encode() for n in property_names(grammar.schema)
                ),
            )
    start_mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    template.unsafe_compute_mask_ptr(start_mask.ctypes.data, start_mask.nbytes)
    index = dataclasses.replace(index, start_mask=start_mask)
    row = index.new_row()
    row.closing_path(limit=START_WALK)
    kept = getattr(row, "row", row).last_walk  # the walk, as far as it went (None: no way)
    start = None if kept is None else (kept[0], kept[3])
    return messages, dataclasses.replace(index, start_walk=start)
