"""Serving metrics of one engine run: throughput, TTFT/TPOT percentiles, goodput, MBU, and the
decode steps placed on the roofline.

Definitions (times on the run's virtual clock, see `quantkit.batching.engine`):

- throughput: output tokens (the first one, from the prefill, included) and completed requests
  per second of the run, first arrival to last token.
- TTFT: arrival -> first token, so it includes queueing; percentiles over requests.
- TPOT: the gap between two consecutive tokens of one request, one sample per token after the
  first, percentiles over every such gap of every request (as `quantkit.runtime.stats` times each
  decode step). A long prefill that stalls the running requests shows up in the tail of these
  gaps, which is what chunked prefill shortens. `req_tpot_ms_*` are the per-request means
  ((last - first token) / (tokens - 1)), the figure an SLO on TPOT is checked against.
- goodput: completed requests per second whose TTFT <= the TTFT SLO and whose mean TPOT <= the
  TPOT SLO (DistServe's definition); an SLO left out is not checked.
- MBU: the bytes the decode steps read (every weight once per step + each decoded row's KV
  cache up to its position) over the time those steps took, against the peak bandwidth.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from quantkit.batching.types import DecodeStep, RunResult
from quantkit.errors import GenerationError
from quantkit.models.decoder import CausalLM
from quantkit.perf.roofline import model_kv_bytes_per_token, model_read_bytes
from quantkit.runtime.stats import percentile

__all__ = [
    "SLO",
    "ServingMetrics",
    "StepCost",
    "decode_points",
    "parse_duration",
    "summarize",
]

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_duration(text: str, *, option: str = "duration") -> float:
    """Seconds from a duration with a unit: `50ms`, `0.5s`, `200us`. A bare number is refused,
    since `--slo-tpot 50` could mean 50 ms or 50 s."""
    match = _DURATION.match(text)
    if match is None:
        raise GenerationError(
            f"{option}: expected a positive duration with a unit (us, ms or s, e.g. 50ms or "
            f"0.5s), got {text!r}"
        )
    value = float(match[1]) * _UNIT_S[match[2].lower()]
    if not value > 0:
        raise GenerationError(f"{option}: expected a positive duration, got {text!r}")
    return value


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; None = not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        ok_ttft = self.ttft_s is None or ttft_s <= self.ttft_s
        # A one-token request has no TPOT (NaN): nothing to miss.
        ok_tpot = self.tpot_s is None or math.isnan(tpot_s) or tpot_s <= self.tpot_s
        return ok_ttft and ok_tpot


@dataclass(frozen=True)
class StepCost:
    """What one decode step costs a model, for MBU and the roofline.

    weight_bytes: weights read once per step (`WeightBytes.read_per_step`).
    kv_bytes_per_token: K/V bytes of one cached position, all layers.
    flops_per_token: 2 x the multiply-adds of every Linear and the lm_head, per row.
    attn_flops_per_position: QK^T and AV flops per row per cached position attended to.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    attn_flops_per_position: float

    @classmethod
    def from_model(cls, model: CausalLM) -> StepCost:
        c = model.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h, i = c.hidden_size, c.intermediate_size
        per_layer = q * h + 2 * kv * h + h * q + 3 * i * h
        macs = c.num_layers * per_layer + c.vocab_size * h
        return cls(
            weight_bytes=float(model_read_bytes(model).read_per_step),
            kv_bytes_per_token=float(model_kv_bytes_per_token(model)),
            flops_per_token=2.0 * macs,
            attn_flops_per_position=4.0 * c.num_layers * q,
        )

    def step_bytes(self, step: DecodeStep) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * step.context_tokens

    def step_flops(self, step: DecodeStep) -> float:
        return self.flops_per_token * step.rows + self.attn_flops_per_position * (
            step.context_tokens
        )


@dataclass(frozen=True)
class ServingMetrics:
    requests: int
    completed: int
    rejected: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    throughput_tok_s: float
    throughput_req_s: float
    ttft_ms_p50: float
    ttft_ms_p95: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p95: float
    tpot_ms_p99: float
    req_tpot_ms_p50: float
    req_tpot_ms_p99: float
    goodput_req_s: float
    slo_attainment: float
    decode_steps: int
    mean_batch: float
    decode_tok_s: float
    mbu: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN (nothing to summarize) becomes None."""
        return {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in asdict(self).items()
        }


def _ms(values: list[float], q: float) -> float:
    return 1e3 * percentile(values, q)


def summarize(
    run: RunResult, *, slo: SLO, cost: StepCost | None = None, bandwidth: float | None = None
) -> ServingMetrics:
    """The metrics of `run` (see the module docstring). MBU needs `cost` and `bandwidth`
    (bytes/s); without them it is None."""
    done = [r for r in run.requests if r.finish_reason not in (None, "rejected")]
    rejected = sum(r.finish_reason == "rejected" for r in run.requests)
    duration = run.duration_s
    ttfts = [r.ttft_s for r in done if r.token_times_s]
    gaps = [g for r in done for g in r.gaps_s]
    req_tpot = [
        (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
        if len(r.token_times_s) > 1
        else math.nan
        for r in done
    ]
    good = sum(slo.met(r.ttft_s, t) for r, t in zip(done, req_tpot, strict=True) if r.token_times_s)
    output = sum(len(r.tokens) for r in done)
    steps = run.decode_steps
    # Decode speed and MBU from the steps that only decoded: a step that carried prefill
    # chunks spent its time on both.
    pure = [s for s in steps if not s.prefill_tokens]
    step_s = math.fsum(s.seconds for s in pure)
    rows = sum(s.rows for s in pure)
    mbu = None
    if cost is not None and bandwidth and step_s > 0:
        mbu = math.fsum(cost.step_bytes(s) for s in pure) / step_s / bandwidth
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: math.nan)
    finite_req_tpot = [t for t in req_tpot if not math.isnan(t)]
    return ServingMetrics(
        requests=len(run.requests),
        completed=len(done),
        rejected=rejected,
        duration_s=duration,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=output,
        throughput_tok_s=per_s(output),
        throughput_req_s=per_s(len(done)),
        ttft_ms_p50=_ms(ttfts, 50),
        ttft_ms_p95=_ms(ttfts, 95),
        ttft_ms_p99=_ms(ttfts, 99),
        tpot_ms_p50=_ms(gaps, 50),
        tpot_ms_p95=_ms(gaps, 95),
        tpot_ms_p99=_ms(gaps, 99),
        req_tpot_ms_p50=_ms(finite_req_tpot, 50),
        req_tpot_ms_p99=_ms(finite_req_tpot, 99),
        goodput_req_s=per_s(good),
        slo_attainment=good / len(run.requests),
        decode_steps=len(steps),
        mean_batch=sum(s.rows for s in steps) / len(steps) if steps else math.nan,
        decode_tok_s=rows / step_s if step_s > 0 else math.nan,
        mbu=mbu,
    )


def decode_points(steps: list[DecodeStep], cost: StepCost) -> list[dict[str, float]]:
    """The decode steps grouped by batch size, for the roofline plot: per size, the median
    step time and the mean FLOPs and bytes of a step, hence its arithmetic intensity (FLOP/byte)
    and the FLOP/s and bytes/s it achieved. Steps whose forward also ran rows with nothing to
    decode (window > rows: free or riding-along slots) are left out, since their work is not
    the batch size's."""
    groups: dict[int, list[DecodeStep]] = defaultdict(list)
    for step in steps:
        if step.window == step.rows:
            groups[step.rows].append(step)
    points = []
    for batch in sorted(groups):
        group = groups[batch]
        seconds = statistics.median(s.seconds for s in group)
        flops = statistics.fmean(cost.step_flops(s) for s in group)
        moved = statistics.fmean(cost.step_bytes(s) for s in group)
        points.append(
            {
                "batch": batch,
                "steps": len(group),
                "step_ms": 1e3 * seconds,
                "flops": flops,
                "bytes": moved,
                "intensity": flops / moved,
                "flop_s": flops / seconds,
                "bytes_s": moved / seconds,
                "tok_s": batch / seconds,
            }
        )
    return points
