"""GenerationStats on synthetic latencies whose percentiles are worked out by hand; Timer."""

from __future__ import annotations

import json
import math
import time

import pytest

from quantkit.runtime.stats import GenerationStats, Timer, percentile


def _stats(**overrides: object) -> GenerationStats:
    # 11 tokens: prefill 0.2 s, then 10 decode steps of 10..19 ms (plus nothing else).
    latencies = [0.010 + 0.001 * i for i in range(10)]
    values: dict = {
        "prompt_tokens": 100,
        "generated_tokens": 11,
        "ttft_s": 0.2,
        "decode_latencies_s": latencies,
        "wall_s": 0.2 + sum(latencies),
    }
    values.update(overrides)
    return GenerationStats(**values)


def test_percentiles_by_hand() -> None:
    values = [0.010 + 0.001 * i for i in range(10)]  # 10, 11, ..., 19 ms
    # Rank (n-1) q/100 = 9 q/100: p50 -> 4.5 -> 14.5 ms; p90 -> 8.1 -> 18.1; p99 -> 8.91 -> 18.91.
    assert percentile(values, 50) == pytest.approx(0.0145, abs=1e-12)
    assert percentile(values, 90) == pytest.approx(0.0181, abs=1e-12)
    assert percentile(values, 99) == pytest.approx(0.01891, abs=1e-12)
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    # Order of the input does not matter.
    assert percentile(values[::-1], 90) == pytest.approx(0.0181, abs=1e-12)
    with pytest.raises(ValueError, match=r"expected q in \[0, 100\], got 101"):
        percentile(values, 101)


def test_properties() -> None:
    s = _stats()
    assert s.tpot_ms_p50 == pytest.approx(14.5)
    assert s.tpot_ms_p90 == pytest.approx(18.1)
    assert s.tpot_ms_p99 == pytest.approx(18.91)
    assert s.tpot_ms_mean == pytest.approx(14.5)
    # 10 steps in 0.145 s.
    assert s.decode_tok_s == pytest.approx(10 / 0.145)
    assert s.prompt_tok_s == pytest.approx(500.0)
    # TTFT + (11 - 1) x 14.5 ms = 0.345 s, equal to the wall time given.
    assert s.e2e_model_s == pytest.approx(0.345)
    assert s.consistency() == pytest.approx(0.0, abs=1e-12)


def test_consistency_flags_unaccounted_time() -> None:
    s = _stats(wall_s=0.345 / 0.8)  # the steps explain 80% of the wall time
    assert s.consistency() == pytest.approx(0.2)


def test_batch_decode_throughput_counts_every_sequence() -> None:
    s = _stats(batch_size=8)
    assert s.decode_tok_s == pytest.approx(8 * 10 / 0.145)
    assert s.tpot_ms_p50 == pytest.approx(14.5)  # latency per step does not change


def test_to_dict_keys_values_and_json() -> None:
    d = _stats().to_dict()
    required = {
        "ttft_ms",
        "tpot_ms_p50",
        "tpot_ms_p90",
        "tpot_ms_p99",
        "decode_tok_s",
        "prompt_tok_s",
        "prompt_tokens",
        "generated_tokens",
        "e2e_ms",
        "wall_ms",
    }
    assert required <= d.keys()
    assert d["ttft_ms"] == pytest.approx(200.0)
    assert d["e2e_ms"] == pytest.approx(345.0)
    assert d["wall_ms"] == pytest.approx(345.0)
    assert d["tpot_ms_p99"] == pytest.approx(18.91)
    assert d["prompt_tokens"] == 100 and d["generated_tokens"] == 11
    json.dumps(d, allow_nan=False)


def test_single_token_has_no_decode_steps() -> None:
    s = GenerationStats(prompt_tokens=5, generated_tokens=1, ttft_s=0.05, wall_s=0.05)
    assert math.isnan(s.tpot_ms_p50) and math.isnan(s.decode_tok_s)
    assert s.e2e_model_s == 0.05
    d = s.to_dict()
    assert d["tpot_ms_p50"] is None and d["decode_tok_s"] is None
    json.dumps(d, allow_nan=False)  # valid JSON: no NaN literal


def test_latency_count_must_match_tokens() -> None:
    with pytest.raises(ValueError) as info:
        _stats(generated_tokens=5)
    assert str(info.value) == (
        "decode_latencies_s: expected generated_tokens - 1 = 4 decode steps "
        "(the first token comes from prefill), got 10"
    )


def test_timer_laps_add_up_to_elapsed() -> None:
    timer = Timer("cpu").start()
    time.sleep(0.02)
    first = timer.lap()
    time.sleep(0.01)
    second = timer.lap()
    total = timer.elapsed()
    assert first >= 0.02 and second >= 0.01
    assert total >= first + second
    with Timer() as t:
        time.sleep(0.01)
    assert t.elapsed_s >= 0.01
    with pytest.raises(RuntimeError, match="never started"):
        Timer().lap()
