"""Token log-probabilities (`runtime.scoring`) and OpenAI's presence and frequency penalties
(`runtime.sampling.PresenceFrequencyPenalty`), on hand-made logits and a tiny random model."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.evals.accuracy.continuations import score_continuations
from quantkit.runtime.loader import load_model
from quantkit.runtime.sampling import PresenceFrequencyPenalty, SamplingParams, sample
from quantkit.runtime.scoring import log_probs, prompt_logprobs, token_logprob


def test_prompt_logprobs_equal_a_forward_and_the_lm_eval_scorer(tiny_llama_dir) -> None:
    model = load_model(tiny_llama_dir, tokenizer=False).model
    ids = [5, 17, 3, 99, 42, 8, 61, 7, 12, 30]
    with torch.inference_mode():
        expected = log_probs(model(torch.tensor([ids]))[0])
    for chunk in (3, 256):  # several forwards into one cache, or one
        got = prompt_logprobs(model, ids, top=4, chunk=chunk)
        assert got[0] is None and len(got) == len(ids)
        for t, entry in enumerate(got[1:], start=1):
            assert entry is not None and entry.token == ids[t]
            assert abs(entry.logprob - float(expected[t - 1, ids[t]])) < 1e-4
            values = [v for _, v in entry.top]
            assert len(values) == 4 and values == sorted(values, reverse=True)
    ((scored, _),) = score_continuations(model, [ids[:4]], [[ids[4:]]])[0]
    total = sum(e.logprob for e in prompt_logprobs(model, ids)[4:] if e is not None)
    assert abs(total - scored) < 1e-4
    assert all(layer.self_attn.cache is None for layer in model.model.layers)


def test_token_logprob_top_is_sorted_and_sized() -> None:
    logprobs = log_probs(torch.tensor([0.5, 3.0, -1.0, 2.0]))
    entry = token_logprob(logprobs, 0, 2)
    assert [t for t, _ in entry.top] == [1, 3] and entry.logprob == float(logprobs[0])
    assert token_logprob(logprobs, 0, 0).top == ()


def _greedy_after(processor: PresenceFrequencyPenalty, history: list[list[int]]) -> int:
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    out = processor(torch.tensor(history), logits)
    return int(sample(out, SamplingParams(), generator=torch.Generator())[0])


def test_presence_and_frequency_penalties_move_sampling_as_openai_says() -> None:
    prompt = [1, 3]  # token 1 is only in the prompt: never penalized
    generated = [[1, 3, 0, 0]]
    assert _greedy_after(PresenceFrequencyPenalty(0.0, 0.0, prompt), generated) == 0
    # presence: 2.0 - 0.5 = 1.5 < 1.9; frequency: 2.0 - 2 x 0.1 = 1.8 < 1.9
    assert _greedy_after(PresenceFrequencyPenalty(0.5, 0.0, prompt), generated) == 1
    assert _greedy_after(PresenceFrequencyPenalty(0.0, 0.1, prompt), generated) == 1
    assert _greedy_after(PresenceFrequencyPenalty(0.0, 0.04, prompt), [[1, 3, 0]]) == 0
    # negative values favour what was generated: token 3 (prompt + once generated) overtakes
    penalty = PresenceFrequencyPenalty(-1.0, -2.0, prompt)
    out = penalty(torch.tensor([[1, 3, 3]]), torch.tensor([[2.0, 1.9, 0.0, -1.0]]))
    assert torch.allclose(out, torch.tensor([[2.0, 1.9, 0.0, 2.0]]))
    # however the caller aligns the rows (right-aligned, -1 where empty): the same counts
    left = penalty(torch.tensor([[1, 3, 3, -1]]), torch.zeros(1, 4))
    right = penalty(torch.tensor([[-1, 1, 3, 3]]), torch.zeros(1, 4))
    assert torch.equal(left, right)


@pytest.mark.parametrize("bad", [2.5, -2.01, float("nan"), float("inf")])
def test_penalties_out_of_range_are_refused(bad: float) -> None:
    with pytest.raises(GenerationError, match="presence_penalty"):
        PresenceFrequencyPenalty(bad, 0.0, [])
