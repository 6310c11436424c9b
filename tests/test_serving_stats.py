"""Serving metrics on hand-built runs (every number checked by hand), SLO durations, step costs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from quantkit.batching.engine import DecodeStep, EngineConfig, RequestResult, RunResult
from quantkit.batching.metrics import SLO, StepCost, decode_points, parse_duration, summarize
from quantkit.errors import GenerationError
from quantkit.runtime.loader import load_model


@pytest.mark.parametrize(
    "text,seconds",
    [("50ms", 0.05), ("0.5s", 0.5), ("200us", 2e-4), (" 2 s ", 2.0), ("1.5MS", 0.0015)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["50", "0ms", "-5ms", "5min", "ms", "", "fast"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(GenerationError, match="--slo-tpot: expected a positive duration"):
        parse_duration(text, option="--slo-tpot")


def _run() -> RunResult:
    a = RequestResult(0, 0.0, 10, [1, 2, 3], [0.5, 0.6, 0.8], 0.0, 0.8, "length")
    b = RequestResult(1, 1.0, 20, [4, 5], [3.0, 3.1], 1.0, 3.1, "length")
    c = RequestResult(2, 1.5, 5, [], [], None, 1.5, "rejected")
    steps = [DecodeStep(2, 2, 20, 0.1), DecodeStep(1, 1, 12, 0.2), DecodeStep(1, 2, 8, 0.1)]
    return RunResult([a, b, c], steps, [], EngineConfig(batch_cap=2), start_s=0.0, end_s=4.0)


def test_summary_by_hand() -> None:
    m = summarize(_run(), slo=SLO(ttft_s=1.0, tpot_s=0.16))
    assert (m.requests, m.completed, m.rejected) == (3, 2, 1)
    assert m.output_tokens == 5 and m.prompt_tokens == 30
    assert m.throughput_tok_s == pytest.approx(5 / 4) and m.throughput_req_s == pytest.approx(0.5)
    # TTFT 0.5 and 2.0 s; gaps 0.1, 0.2 (request 0) and 0.1 (request 1).
    assert m.ttft_ms_p50 == pytest.approx(1250) and m.ttft_ms_p99 == pytest.approx(1985)
    assert m.tpot_ms_p50 == pytest.approx(100) and m.tpot_ms_p99 == pytest.approx(198)
    assert m.req_tpot_ms_p50 == pytest.approx(125)  # means 150 and 100 ms
    # Only request 0 meets TTFT <= 1 s, and its mean TPOT 150 ms <= 160 ms.
    assert m.goodput_req_s == pytest.approx(1 / 4) and m.slo_attainment == pytest.approx(1 / 3)
    assert m.decode_steps == 3 and m.mean_batch == pytest.approx(4 / 3)
    assert m.decode_tok_s == pytest.approx(4 / 0.4)
    assert m.mbu is None
    strict = summarize(_run(), slo=SLO(ttft_s=1.0, tpot_s=0.1))
    assert strict.goodput_req_s == 0.0
    assert summarize(_run(), slo=SLO()).goodput_req_s == pytest.approx(0.5)


def test_mbu_and_roofline_points_by_hand() -> None:
    cost = StepCost(
        weight_bytes=1000.0, kv_bytes_per_token=10.0, flops_per_token=500.0,
        attn_flops_per_position=2.0,
    )  # fmt: skip
    m = summarize(_run(), slo=SLO(), cost=cost, bandwidth=10_000.0)
    # Bytes: 1200 + 1120 + 1080 = 3400 over 0.4 s = 8500 B/s of 10000.
    assert m.mbu == pytest.approx(0.85)
    points = decode_points(_run().decode_steps, cost)
    # The third step ran 2 rows for 1 decoded: not counted at either batch size.
    assert [(p["batch"], p["steps"]) for p in points] == [(1, 1), (2, 1)]
    one, two = points
    assert one["flops"] == 500 + 2 * 12 and one["bytes"] == 1120
    assert two["intensity"] == pytest.approx((1000 + 40) / 1200)
    assert two["tok_s"] == pytest.approx(20.0) and one["step_ms"] == pytest.approx(200)


def test_nothing_to_summarize_is_nan_not_an_error() -> None:
    only = RequestResult(0, 0.0, 4, [], [], None, 0.0, "rejected")
    run = RunResult([only], [], [], EngineConfig(), start_s=0.0, end_s=0.0)
    m = summarize(run, slo=SLO())
    assert m.completed == 0 and math.isnan(m.throughput_tok_s)
    assert m.to_dict()["ttft_ms_p50"] is None


def test_step_cost_of_a_model(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, tokenizer=False).model
    cost = StepCost.from_model(model)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    linears = sum(
        m.weight.numel() for n, m in model.model.layers.named_modules() if n.endswith(names)
    )
    # tiny llama: 2 x (128x128 q + 2 x 64x128 k/v + 128x128 o + 3 x 256x128 MLP) + 512x128 head
    assert linears == 2 * 147456
    assert cost.flops_per_token == 2 * (linears + 512 * 128)
    # fp32 tiny llama: 2 layers x K and V x 2 heads x 32 dims x 4 bytes.
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert cost.weight_bytes >= 4 * (linears + model.lm_head.weight.numel())
