"""Generation metrics: TTFT, per-token decode latency (TPOT) percentiles, tokens per second.

The decode loop records one prefill time and one latency per decode step; everything else is
derived here, so the CLI summary, the `--json` output and the benchmark all agree on what
"decode tok/s" means:

- TTFT (time to first token): prompt in -> first generated token out (the prefill plus its
  sampling). It yields the first token, so N generated tokens take one prefill and N - 1 decode
  steps.
- TPOT (time per output token): the latency of one decode step; p50/p90/p99 over the steps.
- decode tok/s: batch_size x decode steps / total decode time (aggregate over the batch).
- E2E model: TTFT + (N - 1) x mean TPOT, which `consistency()` checks against the wall time
  measured around the whole call; a large gap means time went somewhere the model does not
  account for (tokenization, detokenizing the stream, Python between steps).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

__all__ = ["GenerationStats", "Timer", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), linear between order statistics (numpy's default).

    NaN for an empty list, since there is nothing to summarize (one generated token has no
    decode step).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: expected q in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass
class GenerationStats:
    """Timings of one generate call; times in seconds.

    prompt_tokens: tokens prefilled, summed over the batch.
    generated_tokens: tokens generated per sequence (= decode steps + 1; with a batch whose rows
        stop at different times, the steps run, i.e. the longest row).
    ttft_s: time to first token.
    decode_latencies_s: one entry per decode step, so generated_tokens - 1 of them.
    wall_s: the wall time measured around the whole call.
    batch_size: sequences decoded together; each decode step yields one token per sequence.
    """

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_latencies_s: list[float] = field(default_factory=list)
    wall_s: float = math.nan
    batch_size: int = 1
    prefill_skipped: int = 0  # prompt tokens served by a prefix cache instead of prefilled
    speculation: Any = None  # `runtime.speculate.SpecStats` of a speculative run, else None

    def __post_init__(self) -> None:
        expected = max(self.generated_tokens - 1, 0)
        if len(self.decode_latencies_s) != expected:
            raise ValueError(
                f"decode_latencies_s: expected generated_tokens - 1 = {expected} decode steps "
                f"(the first token comes from prefill), got {len(self.decode_latencies_s)}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {self.batch_size}")

    @property
    def decode_s(self) -> float:
        return math.fsum(self.decode_latencies_s)

    @property
    def tpot_ms_mean(self) -> float:
        n = len(self.decode_latencies_s)
        return 1e3 * self.decode_s / n if n else math.nan

    @property
    def tpot_ms_p50(self) -> float:
        return 1e3 * percentile(self.decode_latencies_s, 50)

    @property
    def tpot_ms_p90(self) -> float:
        return 1e3 * percentile(self.decode_latencies_s, 90)

    @property
    def tpot_ms_p99(self) -> float:
        return 1e3 * percentile(self.decode_latencies_s, 99)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of the decode steps alone, summed over the batch."""
        decode_s = self.decode_s
        return self.batch_size * len(self.decode_latencies_s) / decode_s if decode_s else math.nan

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else math.nan

    @property
    def e2e_model_s(self) -> float:
        """TTFT + (N - 1) x mean TPOT: what the per-step timings add up to."""
        if self.generated_tokens <= 1:
            return self.ttft_s
        return self.ttft_s + (self.generated_tokens - 1) * self.tpot_ms_mean / 1e3

    def consistency(self) -> float:
        """|E2E model - wall| / wall: 0.02 means the steps explain all but 2% of the wall time."""
        if not self.wall_s > 0:
            return math.nan
        return abs(self.e2e_model_s - self.wall_s) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready summary; an undefined value (no decode step) is None, not NaN."""
        values: dict[str, float | int] = {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "batch_size": self.batch_size,
            "ttft_ms": 1e3 * self.ttft_s,
            "tpot_ms_p50": self.tpot_ms_p50,
            "tpot_ms_p90": self.tpot_ms_p90,
            "tpot_ms_p99": self.tpot_ms_p99,
            "tpot_ms_mean": self.tpot_ms_mean,
            "decode_tok_s": self.decode_tok_s,
            "prompt_tok_s": self.prompt_tok_s,
            "e2e_ms": 1e3 * self.e2e_model_s,
            "wall_ms": 1e3 * self.wall_s,
            "prefill_skipped_tokens": self.prefill_skipped,
        }
        out: dict[str, Any] = {
            k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()
        }
        if self.speculation is not None:
            out["speculation"] = self.speculation.as_dict()
        return out


class Timer:
    """Wall-clock timer on `time.perf_counter` that waits for the device before each reading.

    CUDA kernels run asynchronously, so without `torch.cuda.synchronize` a reading would measure
    the launch, not the work. On CPU nothing is synchronized.

        timer = Timer(device).start()
        logits = prefill(...)
        ttft = timer.lap()            # seconds since start
        for ...:
            decode_one_token(...)
            latencies.append(timer.lap())  # seconds since the previous lap
        wall = timer.elapsed()        # seconds since start
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._start: float | None = None
        self._last: float | None = None
        self.elapsed_s: float = math.nan  # set by the context manager on exit

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def start(self) -> Timer:
        self._start = self._last = self._now()
        return self

    def lap(self) -> float:
        """Seconds since the previous lap (or since start)."""
        if self._last is None:
            raise RuntimeError("Timer.lap: expected a started timer, got one never started")
        now = self._now()
        lap, self._last = now - self._last, now
        return lap

    def elapsed(self) -> float:
        """Seconds since start."""
        if self._start is None:
            raise RuntimeError("Timer.elapsed: expected a started timer, got one never started")
        return self._now() - self._start

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.elapsed_s = self.elapsed()
