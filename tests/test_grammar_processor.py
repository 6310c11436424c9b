"""The constraint processor on hand-built tiny vocabularies, driven by a fake model (random
logits) in a small decode loop: masked tokens are never sampled, EOS only where the grammar is
complete, multi-byte UTF-8 pieces, a batch of different grammars, padded vocabularies."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from quantkit.errors import GrammarError
from quantkit.grammar.compiler import compile_grammar
from quantkit.grammar.constraints import (
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
    validate_json,
)
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.vocabulary import TokenVocabulary, byte_decoder

EOS = (0, 2)
PIECES = [*'{}[]":, abcdefghijklmnopqrstuvwxyz0123456789.-', '"a', "true", "false", "null",
          '"name"', "é", b"\xc3", b"\xa9", "ab", "bc"]  # fmt: skip


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    table = {i + 3: p if isinstance(p, bytes) else p.encode() for i, p in enumerate(PIECES)}
    # size 72 > the 3 + len(PIECES) ids in use: the rest is embedding padding.
    return TokenVocabulary.from_bytes(table, eos_token_ids=EOS, size=72)


def decode(vocab: TokenVocabulary, tokens: list[int]) -> str:
    return b"".join(vocab.token_bytes[t] for t in tokens).decode("utf-8")


def run_loop(processor, vocab, *, batch: int, steps: int = 80, seed: int = 0, width: int = 72):
    """Sample from random logits through the processor; return (tokens, finished) per row and
    check on the way that every sampled token was allowed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((batch, 3), 5)
    outs: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    for _ in range(steps):
        logits = torch.randn(batch, width, generator=gen) * 3
        masked = processor(ids, logits)
        assert torch.isfinite(masked).any(dim=-1).all()
        token = torch.multinomial(masked.softmax(-1), 1, generator=gen).squeeze(1)
        for b in range(batch):
            if done[b]:
                token[b] = -1
                continue
            assert torch.isfinite(masked[b, token[b]]), "a masked token was sampled"
            if int(token[b]) in EOS:
                done[b] = True
            else:
                outs[b].append(int(token[b]))
        ids = torch.cat([ids, token[:, None]], 1)
        if all(done):
            break
    return outs, done


def test_masked_tokens_are_never_sampled_and_outputs_match(vocab: TokenVocabulary) -> None:
    compiled = compile_grammar(regex_grammar("[a-c]{2,5}(true|null)"), vocab, timeout_s=None)
    for seed in range(5):
        processor = GrammarLogitsProcessor(compiled)
        (tokens,), (done,) = run_loop(processor, vocab, batch=1, seed=seed)
        assert done
        assert re.fullmatch("[a-c]{2,5}(true|null)", decode(vocab, tokens))


def test_eos_only_when_the_pattern_is_complete(vocab: TokenVocabulary) -> None:
    compiled = compile_grammar(regex_grammar("ab+"), vocab, timeout_s=None)
    processor = GrammarLogitsProcessor(compiled)
    a, b = 3 + PIECES.index("a"), 3 + PIECES.index("b")
    logits = torch.zeros(1, 72)
    first = processor(torch.tensor([[7]]), logits)
    assert torch.isinf(first[0, list(EOS)]).all()  # "" is not complete
    second = processor(torch.tensor([[7, a]]), logits)
    assert torch.isinf(second[0, list(EOS)]).all()  # "a" is not complete
    assert torch.isfinite(second[0, b])
    third = processor(torch.tensor([[7, a, b]]), logits)
    assert torch.isfinite(third[0, list(EOS)]).all()  # "ab": every EOS id allowed
    assert processor.finished == [True]
    # Padding ids (>= the 3 + len(PIECES) tokens with bytes) are never allowed.
    assert torch.isinf(third[0, 3 + len(PIECES) :]).all()


def test_multi_byte_utf8_pieces(vocab: TokenVocabulary) -> None:
    # "é" exists whole and as its two UTF-8 bytes; both paths must be allowed, and the
    # bytes must come out as valid UTF-8 whichever is taken.
    compiled = compile_grammar(regex_grammar("xé{2}y"), vocab, timeout_s=None)
    processor = GrammarLogitsProcessor(compiled)
    x, whole = 3 + PIECES.index("x"), 3 + PIECES.index("é")
    lead, tail = 3 + PIECES.index(b"\xc3"), 3 + PIECES.index(b"\xa9")
    logits = torch.zeros(1, 72)
    processor(torch.tensor([[9]]), logits)
    after_x = processor(torch.tensor([[9, x]]), logits)
    assert torch.isfinite(after_x[0, [whole, lead]]).all() and torch.isinf(after_x[0, tail])
    after_lead = processor(torch.tensor([[9, x, lead]]), logits)
    allowed = torch.isfinite(after_lead[0]).nonzero().flatten().tolist()
    assert allowed == [tail]
    for seed in range(4):
        (tokens,), (done,) = run_loop(GrammarLogitsProcessor(compiled), vocab, batch=1, seed=seed)
        assert done and decode(vocab, tokens) == "xééy"


def test_batch_of_three_different_grammars(vocab: TokenVocabulary) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "n": {"enum": ["ab", "bc"]}},
        "required": ["a", "n"],
        "additionalProperties": False,
    }
    grammars = [json_schema_grammar(schema), choice_grammar(["yes", "no", "maybe"]),
                regex_grammar("[0-9]{2,4}")]  # fmt: skip
    compiled = [compile_grammar(g, vocab, timeout_s=None) for g in grammars]
    processor = GrammarLogitsProcessor(compiled)
    outs, done = run_loop(processor, vocab, batch=3, steps=120, seed=3)
    assert all(done)
    text = [decode(vocab, t) for t in outs]
    assert validate_json(text[0], schema) is None, text[0]
    assert text[1] in ("yes", "no", "maybe")
    assert re.fullmatch("[0-9]{2,4}", text[2])
    stats = processor.mask_stats()
    assert stats["calls"] >= 2 and stats["p99_us"] >= stats["mean_us"] / 10 > 0


def test_budget_steers_every_row_to_a_complete_document(vocab: TokenVocabulary) -> None:
    # An unbounded string and random logits: without the budget most runs would not end.
    compiled = compile_grammar(regex_grammar('"[a-j ]*"'), vocab, timeout_s=None)
    assert compiled.plan is not None
    for seed in range(4):
        budget = 12 + seed
        processor = GrammarLogitsProcessor([compiled] * 2, max_new_tokens=budget)
        outs, done = run_loop(processor, vocab, batch=2, steps=budget, seed=seed)
        assert all(done), seed  # EOS came within max_new_tokens
        for tokens in outs:
            assert len(tokens) < budget and re.fullmatch('"[a-j ]*"', decode(vocab, tokens))
    unsteered = GrammarLogitsProcessor(compiled)
    outs, done = run_loop(unsteered, vocab, batch=1, steps=12, seed=1)
    assert not unsteered.steered


def test_byte_plan_states_match_the_token_index(vocab: TokenVocabulary) -> None:
    import outlines_core

    from quantkit.grammar.budget import byte_vocabulary

    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "boolean"}}})
    tokens = compile_grammar(grammar, vocab, engine="outlines", timeout_s=None)
    byte_index = compile_grammar(
        grammar, byte_vocabulary(), engine="outlines", timeout_s=None, plan=False
    ).index
    token_guide, byte_guide = outlines_core.Guide(tokens.index), outlines_core.Guide(byte_index)
    ids = [3 + PIECES.index(p) for p in ["{", '"a', '"', ":", "true", "}"]]
    for token in ids:
        token_guide.advance(token, return_tokens=False)
        for byte in vocab.token_bytes[token]:
            byte_guide.advance(byte, return_tokens=False)
        assert token_guide.get_state() == byte_guide.get_state()
    assert tokens.plan.dist[token_guide.get_state()] == 0


def test_unconstrained_rows_and_reuse_checks(vocab: TokenVocabulary) -> None:
    compiled = compile_grammar(regex_grammar("a"), vocab, timeout_s=None)
    processor = GrammarLogitsProcessor([compiled, None])
    logits = torch.randn(2, 72)
    out = processor(torch.tensor([[1], [1]]), logits)
    assert torch.equal(out[1], logits[1])  # no grammar: untouched
    with pytest.raises(GrammarError, match="reset"):
        processor(torch.tensor([[1], [1]]), logits)  # same width again: a new generation
    processor.reset()
    processor(torch.tensor([[1], [1]]), logits)
    with pytest.raises(GrammarError, match="expected 2 rows"):
        GrammarLogitsProcessor([compiled, None])(torch.tensor([[1]]), logits[:1])
    with pytest.raises(GrammarError, match="not allowed by the grammar"):
        bad = GrammarLogitsProcessor(compiled)
        bad(torch.tensor([[1]]), logits[:1])
        bad(torch.tensor([[1, 3 + PIECES.index("b")]]), logits[:1])


def test_logits_narrower_than_the_vocabulary(vocab: TokenVocabulary) -> None:
    compiled = compile_grammar(regex_grammar("a"), vocab, timeout_s=None)
    with pytest.raises(GrammarError, match="at least as wide"):
        GrammarLogitsProcessor(compiled)(torch.tensor([[1]]), torch.zeros(1, 40))


# --------------------------------------------------------------------------- vocabulary


def test_byte_table_is_a_bijection() -> None:
    table = byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["a"] == ord("a")


def test_vocabulary_from_a_byte_level_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.conftest import make_tokenizer

    tok = AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path)))
    vocab = TokenVocabulary.from_tokenizer(tok, vocab_size=600)
    assert vocab.size == 600 and vocab.eos_token_ids == {tok.eos_token_id}
    special = set(tok.all_special_ids)
    assert not special & set(vocab.token_bytes)
    for token_id, data in list(vocab.token_bytes.items())[:300]:
        text = tok.decode([token_id])
        if "\ufffd" not in text:  # whole characters: the bytes are the decoded text
            assert data == text.encode("utf-8"), token_id
    # Identical tokenizers give identical fingerprints; a different size does not.
    again = TokenVocabulary.from_tokenizer(tok, vocab_size=600)
    assert again.fingerprint == vocab.fingerprint
    assert TokenVocabulary.from_tokenizer(tok).fingerprint != vocab.fingerprint


def test_vocabulary_checks() -> None:
    with pytest.raises(GrammarError, match="EOS"):
        TokenVocabulary.from_bytes({1: b"a"}, eos_token_ids=[], size=4)
    with pytest.raises(GrammarError, match=r"\[0, 4\)"):
        TokenVocabulary.from_bytes({9: b"a"}, eos_token_ids=[0], size=4)
    with pytest.raises(GrammarError, match="must not have bytes"):
        TokenVocabulary.from_bytes({0: b"a"}, eos_token_ids=[0], size=4)


def test_json_roundtrip_of_the_person_example() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "person.json"
    schema = json.loads(example.read_text())
    assert schema["title"] and schema["description"]
    json_schema_grammar(schema)
