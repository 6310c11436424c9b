"""Synthetic workloads: seeded, Poisson arrivals, the length distributions, long prompts, and
the parsing of the bench's options."""

from __future__ import annotations

import math
import statistics

import pytest

from quantkit.batching.workload import LengthDist, WorkloadSpec, make_workload, parse_rate
from quantkit.errors import GenerationError


def _spec(**kw) -> WorkloadSpec:
    base = dict(
        requests=200,
        rate=5.0,
        prompt_len=LengthDist("uniform", 10, 20),
        output_len=LengthDist("fixed", 8),
    )
    return WorkloadSpec(**{**base, **kw})


def test_same_seed_same_requests_other_seed_others() -> None:
    a = make_workload(_spec(), vocab_size=100, max_total=512)
    b = make_workload(_spec(), vocab_size=100, max_total=512)
    c = make_workload(_spec(seed=1), vocab_size=100, max_total=512)
    assert a == b
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_poisson_arrivals() -> None:
    requests = make_workload(_spec(requests=4000, rate=5.0), vocab_size=100, max_total=512)
    times = [r.arrival_s for r in requests]
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Exponential gaps: mean 1/rate and standard deviation 1/rate (4000 draws: ~2% error).
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.08)


def test_infinite_rate_puts_every_request_at_zero() -> None:
    requests = make_workload(_spec(rate=math.inf), vocab_size=100, max_total=512)
    assert {r.arrival_s for r in requests} == {0.0}


def test_lengths_follow_their_distributions() -> None:
    requests = make_workload(_spec(), vocab_size=100, max_total=512)
    lengths = [len(r.prompt) for r in requests]
    assert min(lengths) == 10 and max(lengths) == 20  # both ends included, 200 draws
    assert {r.max_new_tokens for r in requests} == {8}
    assert all(0 <= t < 100 for r in requests for t in r.prompt)
    logn = LengthDist("lognormal", 100, 0.5)
    draws = make_workload(_spec(requests=2000, prompt_len=logn), vocab_size=100, max_total=4096)
    values = [len(r.prompt) for r in draws]
    assert statistics.median(values) == pytest.approx(100, rel=0.06)
    assert max(values) > 250  # heavy tail: exp(2 sigma) ~ 2.7x the median


def test_long_prompts_and_the_context_cap() -> None:
    spec = _spec(requests=20, long_prompt_frac=0.25, long_prompt_len=300)
    requests = make_workload(spec, vocab_size=100, max_total=512)
    assert sum(len(r.prompt) == 300 for r in requests) == 5
    capped = make_workload(spec, vocab_size=100, max_total=200)
    assert max(len(r.prompt) + r.max_new_tokens for r in capped) == 200


def test_prompts_cut_from_a_token_stream() -> None:
    stream = list(range(1000, 1050))
    requests = make_workload(
        _spec(requests=20), vocab_size=2000, max_total=512, source_tokens=stream
    )
    for r in requests:
        start = stream.index(r.prompt[0])
        assert list(r.prompt) == [stream[(start + i) % 50] for i in range(len(r.prompt))]


@pytest.mark.parametrize(
    "text,want",
    [
        ("64", LengthDist("fixed", 64)),
        ("32-128", LengthDist("uniform", 32, 128)),
        (" 8 - 8 ", LengthDist("uniform", 8, 8)),
        ("lognormal:128:0.6", LengthDist("lognormal", 128, 0.6)),
    ],
)
def test_length_specs(text: str, want: LengthDist) -> None:
    assert LengthDist.parse(text) == want


@pytest.mark.parametrize("text", ["0", "-5", "20-10", "0-10", "abc", "", "lognormal:0:1", "3.5"])
def test_bad_length_specs(text: str) -> None:
    with pytest.raises(GenerationError, match=rf"--prompt-len: expected N, LO-HI .* got '{text}'"):
        LengthDist.parse(text, option="--prompt-len")


def test_rates() -> None:
    assert parse_rate("2.5") == 2.5 and math.isinf(parse_rate("inf"))
    for bad in ("0", "-1", "nan", "fast", "-inf"):
        with pytest.raises(GenerationError, match=f"--rates: expected a positive .* got '{bad}'"):
            parse_rate(bad, option="--rates")
    with pytest.raises(GenerationError, match="rate: expected a positive"):
        _spec(rate=0.0)
    with pytest.raises(GenerationError, match="requests: expected an integer >= 1, got 0"):
        _spec(requests=0)
