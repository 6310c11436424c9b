"""The server's Prometheus metrics, in a registry of its own (not the process-global one, so
two servers in one process, as in tests, do not collide).

- quantkit_requests_total{status}: HTTP responses by status code (counted when the response
  starts; a stream is a 200 from its first byte);
- quantkit_time_to_first_token_seconds: submission -> first token (queueing included);
- quantkit_time_per_output_token_seconds: the gap between consecutive tokens of a request;
- quantkit_requests_running, quantkit_requests_waiting, quantkit_kv_slots_in_use (gauges),
  quantkit_kv_slots_total;
- quantkit_generated_tokens_total;
- quantkit_decode_steps_total{batch_size}: decode forwards by the number of rows they ran.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from quantkit.batching.types import DecodeStep
from quantkit.http_api.engine_loop import LiveRequest

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

# Seconds. TTFT spans queueing (up to seconds on a CPU); TPOT one decode step (ms).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ServerMetrics:
    """The instruments, and the `LoopObserver` hooks the engine thread calls."""

    def __init__(self, *, slots: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "quantkit_requests", "HTTP responses by status code", ["status"], registry=r
        )
        self.ttft = Histogram(
            "quantkit_time_to_first_token_seconds",
            "Submission to first token, queueing included",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "quantkit_time_per_output_token_seconds",
            "Time between consecutive tokens of a request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.running = Gauge("quantkit_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("quantkit_requests_waiting", "Requests queued", registry=r)
        self.slots_in_use = Gauge("quantkit_kv_slots_in_use", "KV cache slots held", registry=r)
        slots_total = Gauge("quantkit_kv_slots_total", "KV cache slots (batch cap)", registry=r)
        slots_total.set(slots)
        self.tokens = Counter("quantkit_generated_tokens", "Tokens generated", registry=r)
        self.steps = Counter(
            "quantkit_decode_steps", "Decode forwards by batch size", ["batch_size"], registry=r
        )
        self.reuse = {
            "drafted": Counter(
                "quantkit_spec_draft_tokens", "Draft tokens verified (speculation)", registry=r
            ),
            "accepted": Counter(
                "quantkit_spec_accepted_tokens", "Draft tokens accepted (speculation)", registry=r
            ),
            "prefix_hit_tokens": Counter(
                "quantkit_prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache instead of prefilled",
                registry=r,
            ),
            "prefix_looked_up_tokens": Counter(
                "quantkit_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache",
                registry=r,
            ),
        }
        self._reused = dict.fromkeys(self.reuse, 0)

    # -- LoopObserver (engine thread)
    def on_token(self, request: LiveRequest, now: float) -> None:
        last = request.last_token_s
        if last is None:
            self.ttft.observe(now - request.submitted_s)
        else:
            self.tpot.observe(now - last)
        request.last_token_s = now
        self.tokens.inc()

    def on_step(self, steps: Sequence[DecodeStep], *, running: int, waiting: int) -> None:
        for rows, n in Tally(s.rows for s in steps).items():
            self.steps.labels(batch_size=str(rows)).inc(n)
        self.running.set(running)
        self.slots_in_use.set(running)
        self.waiting.set(waiting)

    def on_reuse(self, totals: dict[str, int]) -> None:
        for key, counter in self.reuse.items():
            delta = totals.get(key, 0) - self._reused[key]
            if delta > 0:
                counter.inc(delta)
                self._reused[key] += delta

    # -- HTTP side
    def response(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
