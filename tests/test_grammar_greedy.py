"""A greedy processor (`GrammarLogitsProcessor(greedy=True)`) leaves a step unmasked only where
the full mask would have kept the best token: the rows' `allows` never lets through a token the
mask takes out, and decoding gives the same tokens as masking every step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from quantkit.grammar.constraints import validate_json
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import EOS, vocab_of
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


def _decode(processor: GrammarLogitsProcessor, vocab: TokenVocabulary, seed: int,
            *, steps: int) -> list[int]:  # fmt: skip
    """Greedy decoding of a random 'model' (new scores each step, from `seed`), biased toward
    structure so documents get somewhere."""
    rng = np.random.default_rng(seed)
    favourite = np.asarray([vocab.token_bytes.get(t, b"")[:1] in (b'"', b"a", b"0", b"1")
                            for t in range(vocab.size)])  # fmt: skip
    ids, out = torch.zeros((1, 1), dtype=torch.long), []
    for _ in range(steps):
        scores = torch.from_numpy(rng.normal(size=vocab.size) + 1.5 * favourite).float()
        token = int(processor(ids, scores[None]).argmax())
        out.append(token)
        if token in EOS:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_greedy_steps_give_the_tokens_of_masking_every_step(vocab, index: int) -> None:
    compiled = llg(SCHEMAS[index], vocab)
    unmasked = steps = 0
    for seed in range(12):
        full = GrammarLogitsProcessor(compiled, max_new_tokens=60)
        lazy = GrammarLogitsProcessor(compiled, max_new_tokens=60, greedy=True)
        tokens = _decode(full, vocab, seed, steps=60)
        assert _decode(lazy, vocab, seed, steps=60) == tokens, seed
        if tokens[-1] in EOS:
            text = b"".join(vocab.token_bytes[t] for t in tokens[:-1]).decode()
            assert validate_json(text, SCHEMAS[index]) is None, text
        unmasked += lazy.unmasked
        steps += len(lazy.mask_times_s)
    assert 0 < unmasked < steps  # both the unmasked and the masked path were taken


def test_allows_never_lets_through_what_the_mask_takes_out(vocab) -> None:
    """At every state of random documents: the grammar's own `allows` is the mask's bit (for
    every token but the EOS; no token where bytes are forced), and the JSON row's (distinct
    keys and items, runaways, corners) implies it."""
    checked = 0
    for index, schema in enumerate(SCHEMAS):
        compiled = llg(schema, vocab)
        for seed in range(4):
            row = compiled.new_row()
            rng = np.random.default_rng(100 * index + seed)
            for _ in range(40):
                line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
                row.fill(line)
                bits = np.unpackbits(line.view(np.uint8), bitorder="little")[: vocab.size]
                raw = np.zeros_like(line)
                row.row.fill(raw)
                grammar = np.unpackbits(raw.view(np.uint8), bitorder="little")[: vocab.size]
                forced = bool(row.row.matcher.compute_ff_bytes())
                for token in range(vocab.size):
                    if token in EOS:  # the processor's own decision (never asked)
                        continue
                    if forced:  # there the mask decides (see the test below)
                        assert not row.row.allows(token)
                    else:
                        assert row.row.allows(token) == bool(grammar[token]), token
                    if row.allows(token):
                        assert bits[token], (token, vocab.token_bytes.get(token))
                        checked += 1
                allowed = [t for t in np.flatnonzero(bits) if t not in EOS]
                if not allowed or row.is_finished() and rng.random() < 0.2:
                    break
                assert row.advance(int(rng.choice(allowed)))
    assert checked > 500


@pytest.mark.slow
def test_allows_on_the_embedded_vocabulary_where_the_mask_writes_forced_bytes_whole() -> None:
    """With SmolLM2's vocabulary llguidance's mask keeps only `{"` where `{"` is forced, while
    its matcher would take `{`: `allows` says no there (the mask decides), and at every state
    of a document it never says yes to a token the mask leaves out."""
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
    checked = 0
    for token in tok.encode('{"name":"Ada Lovelace","age":36}', add_special_tokens=False):
        line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
        row.fill(line)
        bits = np.unpackbits(line.view(np.uint8), bitorder="little")[: vocab.size]
        if checked == 0:
            assert not bits[brace] and not row.allows(brace)  # ... the mask does not
        for candidate in range(vocab.size):
            if candidate != tok.eos_token_id and row.allows(candidate):
                assert bits[candidate], (candidate, vocab.token_bytes.get(candidate))
                checked += 1
        assert row.advance(token)
    assert checked > 10_000  # the string's states allow most of the vocabulary
