from __future__ import annotations

import math

import pytest
import torch

from quantkit.evals.accuracy.perplexity import _windows, compare_logits, perplexity


def _bigram_lm(table: torch.Tensor):
    """A model whose next-token log-probs depend only on the current token."""
    return lambda ids: table[ids]


def test_perplexity_of_a_known_bigram_model() -> None:
    v = 7
    table = torch.randn(v, v, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, v, (100,), generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(table, -1)
    want = -float(logp[tokens[:-1], tokens[1:]].mean())
    # Context length does not matter to a bigram model: overlapping windows score every token
    # but the first exactly once.
    for window, stride in [(16, 5), (100, 100), (32, 31)]:
        got = perplexity(_bigram_lm(table), tokens, window=window, stride=stride, batch_size=3)
        assert got.tokens == 99
        assert got.nll == pytest.approx(want, rel=1e-5)
        assert got.ppl == pytest.approx(math.exp(want), rel=1e-5)
    # Disjoint windows cannot score the first token of each window (no context for it).
    got = perplexity(_bigram_lm(table), tokens, window=10, stride=10)
    scored = [i for i in range(1, 100) if i % 10]
    assert got.tokens == len(scored) == 90
    assert got.nll == pytest.approx(
        -float(logp[tokens[[i - 1 for i in scored]], tokens[scored]].mean()), rel=1e-5
    )


def test_windows_cover_each_token_once() -> None:
    for n, w, s in [(50, 8, 8), (50, 8, 3), (9, 8, 8), (8, 8, 4)]:
        covered = []
        for b, e, first in _windows(n, w, s):
            covered += list(range(b + first, e))
        assert covered == sorted(set(covered))  # each token at most once, in order
        if s < w:
            assert covered == list(range(1, n))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(lambda x: x, torch.tensor([1]))
    with pytest.raises(ValueError, match="stride"):
        perplexity(lambda x: x, torch.arange(10), window=4, stride=5)


def test_compare_logits_identity_and_difference() -> None:
    table = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(2))
    same = compare_logits(_bigram_lm(table), _bigram_lm(table), tokens, window=16)
    assert same.kl == pytest.approx(0.0, abs=1e-6) and same.top1 == 1.0
    other = compare_logits(_bigram_lm(table), _bigram_lm(-table), tokens, window=16)
    assert other.kl > 0.1 and other.top1 < 0.5


def test_scoring_a_row_at_a_time_adds_up_as_one_batch() -> None:
    # Each row's log-probabilities are taken on their own (memory); the sum is the same bits
    # whatever the batch, and each call's logits are fresh tensors the scorer may drop.
    v = 11
    table = torch.randn(v, v, generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(0, v, (200,), generator=torch.Generator().manual_seed(4))
    seen: list[torch.Tensor] = []

    def lm(ids: torch.Tensor) -> torch.Tensor:
        seen.append(ids)
        return table[ids]

    one = perplexity(lm, tokens, window=32, stride=12, batch_size=1)
    assert {len(ids) for ids in seen} == {1}
    seen.clear()
    four = perplexity(lm, tokens, window=32, stride=12, batch_size=4)
    assert max(len(ids) for ids in seen) == 4
    assert (one.tokens, one.nll) == (four.tokens, four.nll)
