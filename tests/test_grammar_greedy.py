"""A greedy processor (`GrammarLogitsProcessor(greedy=True)`) leaves a step unmasked only where
the rows tell which token the full mask would have left as the best: their verdicts never
contradict the mask, and decoding gives the same tokens as masking every step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from quantkit.grammar.constraints import validate_json
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.verdict import Verdict
from quantkit.grammar.vocabulary import TokenVocabulary
from quantkit.runtime.kept_argmax import keep, kept_argmax
from tests.hand_vocab import EOS, fed_row, vocab_of
from tests.hand_vocab import llguidance as llg

PIECES = [*'{}[]":,abcdefghijklmnopqrstuvwxyz0123456789.-', '"a":', '{"a":', "ab", "00",
          '"a":1,', "BEF_", '"name":"', "true", '","', "]", ' ']  # fmt: skip

# Each schema leads a random model into what narrows a mask beyond the grammar: repeated keys
# (declared, pattern, additional), corners, repeated array items, runaway numbers, strings
# and nesting.
SCHEMAS: list[Any] = [
    {"type": "object"},
    {"type": "object", "patternProperties": {"^(ab|cd|a)$": {"type": "integer"}},
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
     "additionalProperties": {"type": "integer"}},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},
    {"type": "object", "properties": {"n": {"type": "number"}, "name": {"type": "string"}},
     "required": ["n", "name"]},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    # `{"a":` is forced, and llguidance's mask keeps only the token that writes it whole.
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
]  # fmt: skip

pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return vocab_of(PIECES)


def _kept_order(scores: torch.Tensor, top: int = 8) -> torch.Tensor:
    """[1, top]: the first `top` tokens in arg-max order (larger first, the lower id among
    equal scores), as a head kernel keeps them (`kept_argmax.keep`)."""
    order = np.argsort(-scores.numpy(), kind="stable")[:top]
    return torch.from_numpy(order.astype(np.int64))[None]


def _decode(processor: GrammarLogitsProcessor, vocab: TokenVocabulary, seed: int,
            *, steps: int, kinds: dict[str, int] | None = None,
            kept: bool = False) -> list[int]:  # fmt: skip
    """Greedy decoding of a random 'model' (new scores each step, from `seed`), biased toward
    structure so documents get somewhere. kinds: counts the unmasked steps by what came
    back: the logits as they were ("best"), the pick alone past refused tokens ("probed"), or
    one token left along a steering path ("along"). kept: each step's best tokens are kept
    with the logits, as the int8 and int6 heads keep them, so the probe takes them in turn."""
    rng = np.random.default_rng(seed)
    favourite = np.asarray([vocab.token_bytes.get(t, b"")[:1] in (b'"', b"a", b"0", b"1")
                            for t in range(vocab.size)])  # fmt: skip
    ids, out = torch.zeros((1, 1), dtype=torch.long), []
    for _ in range(steps):
        scores = torch.from_numpy(rng.normal(size=vocab.size) + 1.5 * favourite).float()
        before, refused = processor.unmasked, processor.refused
        given = scores[None]
        if kept:
            keep(given, _kept_order(scores))
        result = processor(ids, given)
        if kinds is not None and processor.unmasked > before:
            finite = int(torch.isfinite(result).sum())
            kind = "best" if result is given else "probed" if processor.refused > refused else (
                "along")  # fmt: skip
            assert kind == "best" or finite == 1, kind  # one row: the pick alone is finite
            if kind != "best":  # the pick kept as the row's arg-max: the sampler reads no row
                assert kept_argmax(result) == [int(result.argmax())]
            kinds[kind] = kinds.get(kind, 0) + 1
        token = int(result.argmax())
        out.append(token)
        if token in EOS:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


@pytest.fixture(scope="module")
def decoded(vocab) -> list[dict[str, Any]]:
    """Per schema, 12 seeds decoded by a processor that masks every step and by a greedy one
    (budget 60 tokens, so rows are steered near the end): the tokens of each, and how the
    greedy one's steps went; and the tokens of a greedy one given the head's kept best tokens
    (`_decode`'s kept), with how many it refused."""
    found = []
    for schema in SCHEMAS:
        compiled = llg(schema, vocab)
        runs, unmasked, steps, kinds, refused = [], 0, 0, {}, 0
        for seed in range(12):
            full = GrammarLogitsProcessor(compiled, max_new_tokens=60)
            lazy = GrammarLogitsProcessor(compiled, max_new_tokens=60, greedy=True)
            told = GrammarLogitsProcessor(compiled, max_new_tokens=60, greedy=True)
            tokens = _decode(full, vocab, seed, steps=60)
            runs.append((tokens, _decode(lazy, vocab, seed, steps=60, kinds=kinds),
                         _decode(told, vocab, seed, steps=60, kept=True)))  # fmt: skip
            unmasked += lazy.unmasked
            steps += len(lazy.mask_times_s)
            refused += told.refused
        found.append({"runs": runs, "unmasked": unmasked, "steps": steps, "kinds": kinds,
                      "kept_refused": refused})  # fmt: skip
    return found


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_greedy_steps_give_the_tokens_of_masking_every_step(vocab, decoded, index: int) -> None:
    result = decoded[index]
    for seed, (tokens, greedy, told) in enumerate(result["runs"]):
        assert greedy == tokens, seed
        assert told == tokens, seed  # the head's kept best tokens taken in turn
        if tokens[-1] in EOS:
            text = b"".join(vocab.token_bytes[t] for t in tokens[:-1]).decode()
            assert validate_json(text, SCHEMAS[index]) is None, text
    # both the unmasked and the masked path were taken
    assert 0 < result["unmasked"] < result["steps"]


def test_every_kind_of_unmasked_step_was_taken(decoded) -> None:
    """The schemas above led the greedy processor down each of its ways without the mask:
    the best token allowed, a pick past refused tokens, a pick along a steering path."""
    kinds: dict[str, int] = {}
    for result in decoded:
        for kind, count in result["kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    assert kinds.get("best", 0) > 0 and kinds.get("probed", 0) > 0, kinds
    assert kinds.get("along", 0) > 0, kinds
    # and with the head's best tokens kept, picks past refused ones were taken from them
    assert sum(result["kept_refused"] for result in decoded) > 0


def test_a_refused_best_token_is_followed_by_the_heads_next_one(vocab) -> None:
    """Where the head kept its best tokens, the probe takes them in turn without reading the
    row: kept here in an order that is not the scores' (the true second best is `{`, the kept
    second `{"a":`), the pick is the kept one, and it comes back as the one finite score."""
    ids = {vocab.token_bytes[t]: t for t in range(1, vocab.size) if vocab.token_bytes.get(t)}
    a, brace, brace_key = ids[b"a"], ids[b"{"], ids[b'{"a":']
    scores = torch.full((vocab.size,), -5.0)
    scores[a], scores[brace], scores[brace_key] = 9.0, 8.0, 1.0
    processor = GrammarLogitsProcessor(llg({"type": "object"}, vocab), greedy=True)
    given = scores[None]
    keep(given, torch.tensor([[a, brace_key, brace, -1, -1, -1, -1, -1]]))
    out = processor(torch.zeros((1, 1), dtype=torch.long), given)
    assert processor.refused == 1 and int(out.argmax()) == brace_key
    assert int(torch.isfinite(out).sum()) == 1 and float(out[0, brace_key]) == 1.0
    # without kept tokens the row is read: the scores' second best
    plain = GrammarLogitsProcessor(llg({"type": "object"}, vocab), greedy=True)
    out = plain(torch.zeros((1, 1), dtype=torch.long), scores[None].clone())
    assert plain.refused == 1 and int(out.argmax()) == brace


def test_verdicts_never_contradict_the_mask(vocab) -> None:
    """At every state of random documents: the grammar's own verdict is the mask's bit (for
    every token but the EOS), `UNKNOWN` only where bytes are forced, and there `ALLOWED` only
    for tokens that write them all or, where no token is forced (`forced_tokens` asked
    first, as the decode loop does), their first bytes (in the start state the compile's
    mask tells); the JSON row's (distinct keys and items, runaways, corners) never allows
    what its mask leaves out, nor refuses what it keeps (a repeated key let through where
    nothing else is left aside)."""
    told = {verdict: 0 for verdict in Verdict}
    first_bytes = 0  # tokens allowed that write only the first of the forced bytes
    corners = 0  # tokens refused that the mask keeps and the key screen clears
    for index, schema in enumerate(SCHEMAS):
        compiled = llg(schema, vocab)
        for seed in range(4):
            row = compiled.new_row()
            rng = np.random.default_rng(100 * index + seed)
            for step in range(40):
                line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
                row.fill(line)
                lenient = row.lenient
                bits = np.unpackbits(line.view(np.uint8), bitorder="little")[: vocab.size]
                raw = np.zeros_like(line)
                row.row.fill(raw)
                grammar = np.unpackbits(raw.view(np.uint8), bitorder="little")[: vocab.size]
                forced = bytes(row.row.matcher.compute_ff_bytes())
                none_forced = not row.row.forced_tokens()  # asked as the decode loop does
                refused, any_allowed = [], False
                for token in range(vocab.size):
                    if token in EOS:  # the processor's own decision (never asked)
                        continue
                    own = row.row.verdict(token)
                    if own == Verdict.UNKNOWN:
                        assert forced and grammar[token], token
                    elif own == Verdict.ALLOWED:
                        assert grammar[token], token
                        data = vocab.token_bytes[token]
                        if not data.startswith(forced) and step:  # the start's mask is known
                            assert none_forced and forced.startswith(data), token
                            first_bytes += 1
                    else:
                        assert not grammar[token], token
                    if not forced:
                        assert own == (Verdict.ALLOWED if grammar[token] else Verdict.REFUSED)
                    verdict = row.verdict(token)
                    told[verdict] += 1
                    if verdict == Verdict.ALLOWED:
                        assert bits[token], (token, vocab.token_bytes.get(token))
                        any_allowed = True
                    elif verdict == Verdict.REFUSED:
                        refused.append(token)
                # A refusal holds wherever another token is allowed (`Verdict.REFUSED`): a
                # runaway rule's curb acts once a token it keeps is in the mask, and a token
                # the mask keeps that leads into a corner is cleared by the key screen.
                for token in refused if any_allowed else ():
                    if bits[token] and not lenient:
                        assert _screen_clears(row, line, bits, token), vocab.token_bytes.get(token)
                        corners += 1
                row.lenient = lenient  # as `fill` left it (an allowed verdict resets it)
                allowed = [t for t in np.flatnonzero(bits) if t not in EOS]
                if not allowed or row.is_finished() and rng.random() < 0.2:
                    break
                assert row.advance(int(rng.choice(allowed)))
    assert told[Verdict.ALLOWED] > 500 and told[Verdict.REFUSED] > 500
    assert told[Verdict.UNKNOWN] > 0 and first_bytes > 0 and corners > 0


def _screen_clears(row: Any, line: np.ndarray, bits: np.ndarray, token: int) -> bool:
    """Whether the key screen clears `token` as the best of the tokens the mask `line` keeps
    (`bits`, unpacked), searched afresh: a copy of the matcher, no answers kept from the
    verdicts."""
    scores = np.where(bits > 0, 0.0, -np.inf).astype(np.float32)
    scores[token] = 1.0
    cleared = row.corners.screen(row.state, row.row.matcher, line.copy(), scores, None)
    return token in cleared


def _mask_keeps(row: Any, vocab: TokenVocabulary, piece: str) -> bool:
    line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    row.fill(line)
    token = vocab_token(vocab, piece)
    return bool((int(line.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def vocab_token(vocab: TokenVocabulary, piece: str) -> int:
    return next(t for t, data in vocab.token_bytes.items() if data == piece.encode())


def test_runaway_rules_are_told_without_the_mask(vocab) -> None:
    """A looping string: where its closing quote is allowed the curb keeps only the tokens
    that close it, so a token going on is refused and the quote allowed (no mask asked);
    where the schema holds the string open (minLength) nothing is curbed, and a token going
    on is allowed. Each verdict is what the mask says."""
    loop = '{"name":"' + "befx" * 7
    row = fed_row(vocab, {"type": "object", "properties": {"name": {"type": "string"}}}, loop)
    assert row.runaway.rule(row.state) is not None
    assert row.verdict(vocab_token(vocab, "b")) == Verdict.REFUSED
    assert row.verdict(vocab_token(vocab, '"')) == Verdict.ALLOWED
    assert not _mask_keeps(row, vocab, "b") and _mask_keeps(row, vocab, '"')
    held = {"type": "object", "properties": {"name": {"type": "string", "minLength": 40}}}
    row = fed_row(vocab, held, loop)
    assert row.runaway.rule(row.state) is not None and not row.row.takes_byte(ord('"'))
    assert row.verdict(vocab_token(vocab, "b")) == Verdict.ALLOWED
    assert _mask_keeps(row, vocab, "b")
    # a number past its limit: the curb keeps what ends it
    row = fed_row(vocab, {"type": "object", "properties": {"n": {"type": "number"}}},
               '{"n":' + "1" * 16)  # fmt: skip
    assert row.verdict(vocab_token(vocab, "1")) == Verdict.REFUSED
    assert row.verdict(vocab_token(vocab, "}")) == Verdict.ALLOWED
    assert not _mask_keeps(row, vocab, "1") and _mask_keeps(row, vocab, "}")


def test_a_verdict_holds_its_token_until_the_row_moves() -> None:
    """An allowed verdict consumes its token in the matcher (one llguidance call tells and
    takes it); advancing by that token takes nothing more, and anything else first rolls it
    back: the row reads as it was."""
    vocab = vocab_of(PIECES)
    row = llg({"type": "object", "properties": {"a": {"type": "integer"}}}, vocab).new_row()
    llg_row = row.row
    brace, one = vocab_token(vocab, "{"), vocab_token(vocab, '"a":')
    assert row.verdict(brace) == Verdict.ALLOWED and llg_row.tried == brace
    assert not row.is_finished() and llg_row.tried is None  # read: rolled back
    assert row.verdict(brace) == Verdict.ALLOWED
    assert row.advance(brace) and llg_row.tried is None
    assert row.verdict(one) == Verdict.ALLOWED and llg_row.tried == one
    assert row.advance(vocab_token(vocab, '"a":'))
    assert bytes(llg_row.text) == b'{"a":'
    digit = vocab_token(vocab, "7")
    assert row.verdict(digit) == Verdict.ALLOWED
    assert row.advance(vocab_token(vocab, "8"))  # another token: the held one rolled back
    assert bytes(llg_row.text) == b'{"a":8'
    assert row.verdict(vocab_token(vocab, "a")) == Verdict.REFUSED and llg_row.tried is None


@pytest.mark.slow
def test_allows_on_the_embedded_vocabulary_where_the_mask_writes_forced_bytes_whole() -> None:
    """With SmolLM2's vocabulary llguidance's mask keeps only `{"` where `{"` is forced at the
    start, while its matcher would take `{`: the verdict there reads the start state's mask
    (`REFUSED`), and at every state of a document it never allows a token the mask leaves out,
    nor refuses one it keeps; after a key, with `":"` forced and no token, `":` is allowed."""
    from quantkit.grammar.compiler import compile_grammar
    from quantkit.grammar.constraints import schema_grammar
    from quantkit.sources.resolve import DEFAULT_MODEL, resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_MODEL, progress=False))
    vocab = TokenVocabulary.from_tokenizer(tok, eos_token_ids={tok.eos_token_id})
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    row = compile_grammar(
        schema_grammar(schema), vocab, engine="llguidance", timeout_s=30
    ).new_row()
    brace = tok.convert_tokens_to_ids("{")
    assert row.row.matcher.validate_tokens([brace]) == 1  # the matcher takes it ...
    checked, first_bytes = 0, 0
    by_bytes = row.row.walk.by_bytes  # the first token writing each byte string
    for token in tok.encode('{"name":"Ada Lovelace","age":36}', add_special_tokens=False):
        line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
        row.fill(line)
        bits = np.unpackbits(line.view(np.uint8), bitorder="little")[: vocab.size]
        forced = bytes(row.row.matcher.compute_ff_bytes())
        if forced and not row.forced_tokens():  # as the decode loop asks after each token
            heads = [by_bytes[forced[:n]] for n in range(1, len(forced)) if forced[:n] in by_bytes]
            first_bytes += sum(row.verdict(t) == Verdict.ALLOWED and bits[t] for t in heads)
        if checked == 0:  # ... the mask does not: the start state's mask tells
            assert not bits[brace] and row.verdict(brace) == Verdict.REFUSED
        for candidate in range(vocab.size):
            if candidate == tok.eos_token_id:
                continue
            verdict = row.verdict(candidate)
            if verdict == Verdict.ALLOWED:
                assert bits[candidate], (candidate, vocab.token_bytes.get(candidate))
                checked += 1
            elif verdict == Verdict.REFUSED:
                assert not bits[candidate], (candidate, vocab.token_bytes.get(candidate))
        assert row.advance(token)
    assert checked > 10_000  # the string's states allow most of the vocabulary
    assert first_bytes > 0  # `"` and `":` after `{"name` and `"age`


def test_a_kept_one_hot_pick_is_forgotten_before_its_buffer_is_written(vocab) -> None:
    """A one-hot pick is kept as its buffer's arg-max until the processor writes the buffer
    again: a head that keeps nothing (a soft-capped one) would leave the slot on the buffer,
    and a later mask written into it must not read back as the old pick."""
    for seed in range(40):
        processor = GrammarLogitsProcessor(llg(SCHEMAS[4], vocab), greedy=True)
        rng = np.random.default_rng(seed)
        ids = torch.zeros((1, 1), dtype=torch.long)
        for _ in range(30):
            scores = torch.from_numpy(rng.normal(size=vocab.size)).float()[None]
            refused = processor.refused
            result = processor(ids, scores)
            token = int(result.argmax())
            if result is not scores and processor.refused > refused:
                assert kept_argmax(result) == [token]
                assert processor._buffer(scores) is result
                assert kept_argmax(result) is None
                return
            if token in EOS:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    raise AssertionError("no seed led to a pick past a refused token")
