"""What one run of the continuous-batching engine (`quantkit.batching.engine`) is configured
with and what it records: `EngineConfig`, the per-request results, the decode-step and prefill
records, and the virtual clock the run is timed on."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from quantkit.errors import GenerationError
from quantkit.runtime.speculate import SpecConfig

__all__ = [
    "DecodeStep",
    "check_prefix_cache_mb",
    "EngineConfig",
    "Mode",
    "PrefillChunk",
    "RequestResult",
    "RunResult",
    "VirtualClock",
]

Mode = Literal["continuous", "static"]


# --------------------------------------------------------------------------- config and results


def check_prefix_cache_mb(value: float, *, option: str = "prefix cache") -> float:
    """A prefix-cache budget in MiB: a finite number >= 0 (0 = off); `option` names it in the
    error."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value >= 0):
        raise GenerationError(f"{option}: expected a size >= 0 MiB, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules.

    batch_cap: the most requests decoded together (= KV cache slots).
    mode: "continuous" (re-batch every step) or "static" (a new batch starts only when every
        request of the previous one has finished; finished rows ride along until then).
    chunk: chunked prefill, the most prompt tokens prefilled per step; None = whole prompts
        (every admitted prompt is prefilled in full in the step that admits it).
    admission_limit: the most requests in the system (running + waiting); one arriving beyond
        it is rejected. None = no limit.
    speculate: prompt-lookup speculative decoding (`runtime.speculate`); needs the model's
        one-call decode path (the C step), else it stays off and the run says why.
    prefix_cache_mb: keep the K/V of prompt prefixes, up to this many MiB, and prefill only
        what a new prompt does not share with them (`runtime.prefix_cache`); 0 = off.
    batch_invariant: every decode step row-invariant and prefill chunks cut at multiples of 8
        tokens, so each request gets exactly the tokens `generate` gives it alone, whatever
        runs beside it (and with speculation or the prefix cache on or off); batched steps
        cost more (the C step only).
    """

    batch_cap: int = 8
    mode: Mode = "continuous"
    chunk: int | None = None
    admission_limit: int | None = None
    speculate: SpecConfig | None = None
    prefix_cache_mb: float = 0.0
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.batch_cap, int) and self.batch_cap >= 1):
            raise GenerationError(f"batch cap: expected an integer >= 1, got {self.batch_cap!r}")
        if self.mode not in ("continuous", "static"):
            raise GenerationError(f"mode: expected continuous or static, got {self.mode!r}")
        if self.chunk is not None and not (isinstance(self.chunk, int) and self.chunk >= 1):
            raise GenerationError(
                f"prefill chunk: expected an integer >= 1 tokens (or none), got {self.chunk!r}"
            )
        if self.chunk is not None and self.mode == "static":
            raise GenerationError(
                "prefill chunk: expected continuous batching (static batching prefills whole "
                "batches before decoding), got mode static"
            )
        if self.batch_invariant and self.chunk is not None and self.chunk < 8:
            raise GenerationError(
                f"prefill chunk: expected >= 8 tokens with batch invariance (chunks are cut at "
                f"multiples of 8), got {self.chunk}"
            )
        check_prefix_cache_mb(self.prefix_cache_mb)
        limit = self.admission_limit
        if limit is not None and not (isinstance(limit, int) and limit >= 1):
            raise GenerationError(
                f"admission limit: expected an integer >= 1 (or none), got {limit!r}"
            )


@dataclass
class RequestResult:
    """What happened to one request; times in seconds on the run's virtual clock.

    token_times_s[i]: when token i was emitted (the first comes from the prefill). A rejected
    request has no tokens. finish_reason: "length", "stop" (EOS, not in `tokens`) or "rejected".
    """

    id: int
    arrival_s: float
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    admitted_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float:
        """Arrival -> first token: queueing + prefill (+ the steps that interleave with it)."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else math.nan

    @property
    def gaps_s(self) -> list[float]:
        """The time between consecutive tokens (one TPOT sample per token after the first)."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(frozen=True)
class DecodeStep:
    """One batched decode forward: `rows` requests got a token; the forward ran `window` rows
    (>= rows: free, prefilling or riding-along slots below the highest decoded one, or the
    prompt rows it carried); `context_tokens` = the cache positions the decoded rows attended
    to, summed; `prefill_tokens`: prompt tokens of prefill chunks that rode in the same call
    (its seconds are then both's: decode-only figures leave such steps out)."""

    rows: int
    window: int
    context_tokens: int
    seconds: float
    prefill_tokens: int = 0


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill forward: `tokens` prompt tokens of one request, ending at `end` (its cache
    length afterwards)."""

    tokens: int
    end: int
    seconds: float


@dataclass
class RunResult:
    requests: list[RequestResult]
    decode_steps: list[DecodeStep]
    prefill_chunks: list[PrefillChunk]
    config: EngineConfig
    start_s: float  # the first arrival
    end_s: float  # the last token
    speculation: dict[str, Any] | None = None  # `SpecStats.as_dict()` (+ why off), if asked
    prefix_cache: dict[str, Any] | None = None  # `PrefixCacheStats.as_dict()`, if on

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


# --------------------------------------------------------------------------- clock


class VirtualClock:
    """Seconds since the run began: the wall clock with idle gaps skipped (see module doc).

    step_s: advance exactly this much per forward pass instead (deterministic, for tests).
    """

    def __init__(self, device: torch.device | str = "cpu", *, step_s: float | None = None) -> None:
        if step_s is not None and not step_s > 0:
            raise GenerationError(f"step_s: expected a positive number of seconds, got {step_s}")
        self._cuda = torch.device(device).type == "cuda"
        self._step_s = step_s
        self._t = 0.0  # fixed-step time
        self._start = time.perf_counter()
        self._skipped = 0.0

    def now(self) -> float:
        if self._step_s is not None:
            return self._t
        if self._cuda:  # kernels run asynchronously: time the work, not its launch
            torch.cuda.synchronize()
        return time.perf_counter() - self._start + self._skipped

    def skip_to(self, t: float) -> None:
        """Jump forward to `t` (nothing to do until then); never backward."""
        gap = t - self.now()
        if gap > 0:
            if self._step_s is not None:
                self._t += gap
            else:
                self._skipped += gap

    def forward_done(self) -> None:
        if self._step_s is not None:
            self._t += self._step_s
