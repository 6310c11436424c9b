"""Sampling primitives: each filter on hand-made logits, the sampler's determinism, validation."""

from __future__ import annotations

import math

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.runtime.sampling import (
    LogitsProcessor,
    RepetitionPenalty,
    SamplingParams,
    apply_min_p,
    apply_processors,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    default_processors,
    greedy_tokens,
    logits_to_probs,
    make_generator,
    sample,
)

INF = math.inf


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row != -INF).flatten().tolist() for row in logits]


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(6, 1000, generator=_gen(1))
    params = SamplingParams(temperature=0.0)
    for seed in range(3):
        assert torch.equal(sample(logits, params, generator=_gen(seed)), logits.argmax(-1))
    probs = logits_to_probs(logits, params)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(6))


@pytest.mark.parametrize(
    "logits",
    [
        torch.tensor([[1.0, 3.0, 3.0, 2.0]]),  # a tie: the first maximum
        torch.tensor([[1.0, math.nan, 3.0, math.nan]]),  # NaN counts as the maximum
        torch.full((2, 5), -INF),  # every token masked
        torch.tensor([[INF, 0.0, INF]]),
        torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)),
        torch.randn(4, 10, generator=torch.Generator().manual_seed(1))[:, ::2],  # strided
        torch.randn(2, 7, dtype=torch.bfloat16),  # not fp32: torch's own argmax
    ],
)
def test_greedy_tokens_is_torch_argmax(logits: torch.Tensor) -> None:
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_draws_nothing_from_the_generator() -> None:
    gen = _gen(3)
    state = gen.get_state()
    sample(torch.randn(2, 50), SamplingParams(), generator=gen)
    assert torch.equal(gen.get_state(), state)


def test_top_k_one_is_deterministic_regardless_of_seed() -> None:
    logits = torch.randn(4, 300, generator=_gen(2))
    params = SamplingParams(temperature=1.5, top_k=1)
    for seed in range(10):
        assert torch.equal(sample(logits, params, generator=_gen(seed)), logits.argmax(-1))


def test_masked_tokens_are_never_sampled() -> None:
    # Near-uniform logits, half the vocabulary masked; a hot temperature spreads the draws.
    vocab = 64
    logits = torch.zeros(8, vocab)
    allowed = torch.rand(8, vocab, generator=_gen(5)) < 0.5
    allowed[:, 0] = True
    logits = logits.masked_fill(~allowed, -INF)
    params = SamplingParams(temperature=5.0, seed=0)
    gen = make_generator(params)
    seen = torch.zeros(8, vocab, dtype=torch.bool)
    for _ in range(400):
        tokens = sample(logits, params, generator=gen)
        assert allowed.gather(1, tokens[:, None]).all()
        seen[torch.arange(8), tokens] = True
    # The draws do cover the allowed set: the test would notice a sampler stuck on one token.
    assert seen.sum() == allowed.sum()


def test_sample_frequencies_follow_the_probabilities() -> None:
    # 20k draws of [0.5, 0.3, 0.2]: the standard error of each frequency is <= 0.0036, so
    # 0.015 is over 4 sigma.
    logits = _logits_of([[0.5, 0.3, 0.2]]).expand(20_000, 3)
    tokens = sample(logits, SamplingParams(temperature=1.0), generator=_gen(7))
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.015, rtol=0)


def test_same_seed_same_stream_different_seed_different() -> None:
    logits = torch.randn(3, 500, generator=_gen(4))
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def stream(seed: int) -> torch.Tensor:
        gen = make_generator(SamplingParams(seed=seed))
        return torch.stack([sample(logits, params, generator=gen) for _ in range(30)])

    assert torch.equal(stream(11), stream(11))
    assert not torch.equal(stream(11), stream(12))


def test_apply_temperature() -> None:
    logits = torch.tensor([[2.0, -4.0, 0.0]])
    assert torch.equal(apply_temperature(logits, 2.0), torch.tensor([[1.0, -2.0, 0.0]]))
    with pytest.raises(GenerationError, match=r"expected temperature > 0 .* got 0"):
        apply_temperature(logits, 0.0)


def test_top_k_hand_example() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, -2.0, 7.0, 6.0]])
    assert _kept(apply_top_k(logits, 2)) == [[1, 3], [3, 4]]
    assert torch.equal(apply_top_k(logits, 0), logits)
    assert torch.equal(apply_top_k(logits, None), logits)
    assert torch.equal(apply_top_k(logits, 99), logits)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = _logits_of([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]])
    # Row 0 sorted: 0.5, 0.3, 0.15, 0.05. p=0.7: 0.5 < 0.7, 0.5+0.3 = 0.8 >= 0.7 -> {1, 3}.
    # Row 1: four quarters; 0.7 needs three of them (ties broken by the sort, any three).
    out = apply_top_p(logits, 0.7)
    assert _kept(out)[0] == [1, 3]
    assert len(_kept(out)[1]) == 3
    # p=0.85 needs the third token of row 0 (0.8 < 0.85 <= 0.95).
    assert _kept(apply_top_p(logits, 0.85))[0] == [1, 2, 3]
    # p just above 0 keeps only the top token, never nothing.
    assert _kept(apply_top_p(logits, 1e-6))[0] == [1]
    assert torch.equal(apply_top_p(logits, 1.0), logits)
    # Kept logits are untouched (filters only remove).
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_min_p_hand_example() -> None:
    # p_max = 0.5, min_p = 0.2 -> threshold 0.1: keep 0.5, 0.3, 0.12; drop 0.05, 0.03.
    logits = _logits_of([[0.5, 0.05, 0.3, 0.03, 0.12]])
    assert _kept(apply_min_p(logits, 0.2)) == [[0, 2, 4]]
    # min_p close to 1 keeps only the top token.
    assert _kept(apply_min_p(logits, 0.99)) == [[0]]
    assert torch.equal(apply_min_p(logits, 0.0), logits)


def test_chain_order_and_probs() -> None:
    # top_k=3 then top_p=0.6 on the renormalized three, then softmax.
    logits = _logits_of([[0.4, 0.3, 0.2, 0.1]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    # After top-k: 0.4/0.9, 0.3/0.9, 0.2/0.9 = .444, .333, .222; 0.444 < 0.6 <= 0.777 -> 2 kept.
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_repetition_penalty_hand_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    # Row 0 has tokens 0, 1 (twice) and padding; row 1 has token 3 only.
    input_ids = torch.tensor([[0, 1, 1, -1], [3, -1, -1, -1]])
    out = RepetitionPenalty(2.0)(input_ids, logits)
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.5, 1.5]])
    assert torch.equal(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0]))  # input untouched
    assert isinstance(RepetitionPenalty(1.3), LogitsProcessor)


def test_processors_chain_and_defaults() -> None:
    assert default_processors(SamplingParams()) == []
    (penalty,) = default_processors(SamplingParams(repetition_penalty=1.5))
    assert penalty == RepetitionPenalty(1.5)

    def ban_token_2(input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(1, torch.tensor([2]), -INF)

    logits = torch.tensor([[3.0, 1.0, 9.0]])
    out = apply_processors([RepetitionPenalty(3.0), ban_token_2], torch.tensor([[0]]), logits)
    assert torch.equal(out, torch.tensor([[1.0, 1.0, -INF]]))
    assert sample(out, SamplingParams(), generator=_gen()).tolist() == [0]


def test_sample_rejects_wrong_rank() -> None:
    with pytest.raises(GenerationError, match=r"expected logits \[B, V\], got shape \(5,\)"):
        sample(torch.zeros(5), SamplingParams(), generator=_gen())


def test_valid_params_and_stop_normalised() -> None:
    params = SamplingParams(temperature=0.7, top_k=0, stop=["\n\n", "###"])  # type: ignore[arg-type]
    assert params.stop == ("\n\n", "###")
    assert not params.greedy and SamplingParams().greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature: expected a number >= 0, got -0.1"),
        ({"temperature": math.nan}, "temperature: expected a number >= 0, got nan"),
        ({"top_k": -1}, "top_k: expected an integer >= 0 (0 or None = off), got -1"),
        ({"top_p": 0.0}, "top_p: expected a number in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p: expected a number in (0, 1], got 1.5"),
        ({"min_p": 1.0}, "min_p: expected a number in [0, 1), got 1.0"),
        ({"min_p": -0.1}, "min_p: expected a number in [0, 1), got -0.1"),
        (
            {"repetition_penalty": 0.0},
            "repetition_penalty: expected a number > 0 (1 = off), got 0.0",
        ),
        ({"max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1, got 0"),
        ({"max_new_tokens": -5}, "max_new_tokens: expected an integer >= 1, got -5"),
        ({"max_new_tokens": 2.5}, "max_new_tokens: expected an integer >= 1, got 2.5"),
        ({"top_k": 1.5}, "top_k: expected an integer >= 0 (0 or None = off), got 1.5"),
        ({"stop": "END"}, "stop: expected a tuple of strings, got the string 'END'"),
        ({"stop": ("a", "")}, "stop: expected non-empty strings, got ('a', '')"),
    ],
)
def test_validation_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(GenerationError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_repetition_penalty_validation() -> None:
    with pytest.raises(GenerationError) as info:
        RepetitionPenalty(-1.0)
    assert str(info.value) == "repetition_penalty: expected a finite number > 0, got -1.0"
