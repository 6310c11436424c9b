"""One thread owns the model: HTTP handlers submit requests, the loop steps the engine and hands
each step's tokens back.

`LiveEngine` is the serving engine (`quantkit.batching.engine.SlotEngine`: slots, waiting queue,
chunked prefill, one batched decode per step) with what a server needs on top: every request
samples with its own parameters and `torch.Generator` (so a seeded request gives the same text
whatever it is batched with) and its own logits processors (a grammar for `response_format`, a
repetition penalty), and turns its tokens into text as they come (incremental detokenization,
stop strings held back until they cannot match).

`EngineLoop` runs it on a thread of its own:

- `submit` (any thread) queues a request, or raises a 429 `ServerError` when `max_queue`
  requests are already waiting, or a 503 once the loop is shutting down;
- `cancel` (any thread) marks a request; the next step drops it from the queue or frees its slot;
- each step's token events are handed to `deliver` in one call (the app forwards them to the
  event loop with one `call_soon_threadsafe` per step, not per token);
- `shutdown(deadline_s)` stops accepting, lets in-flight requests finish until the deadline,
  cancels what is left (their last event says "cancelled") and joins the thread.

The thread sleeps on a condition variable while there is no work, so an idle server costs no CPU.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from quantkit.batching.engine import (
    ActiveRequest,
    DecodeStep,
    EngineConfig,
    RequestResult,
    SlotEngine,
    VirtualClock,
)
from quantkit.batching.workload import Request
from quantkit.errors import QuantkitError
from quantkit.http_api.protocol import ServerError
from quantkit.models.decoder import CausalLM
from quantkit.runtime.sampling import (
    LogitsProcessor,
    SamplingParams,
    apply_processors,
    make_generator,
    sample,
)
from quantkit.runtime.textstream import IncrementalDetokenizer, StopStringStream

__all__ = ["EngineLoop", "LiveRequest", "LoopObserver", "TokenEvent"]

_ids = itertools.count()


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request. text: what became final ("" while held back); finish_reason:
    on the last event, "stop" (EOS or a stop string), "length", "cancelled" or "error";
    completion_tokens: generated so far (EOS excluded)."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    error: str | None = None


class LiveRequest:
    """A request as the engine thread sees it. `sink` belongs to whoever submitted it (the app
    keeps its asyncio queue there); the loop never touches it."""

    def __init__(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        params: SamplingParams,
        tokenizer: Any,
        eos_ids: set[int],
        processors: Sequence[LogitsProcessor] = (),
        device: torch.device | str = "cpu",
        sink: Any = None,
    ) -> None:
        self.id = next(_ids)
        self.prompt = tuple(int(t) for t in prompt)
        self.max_tokens, self.params = max_tokens, params
        self.processors = list(processors)
        self.generator = make_generator(params, device)
        self.eos = eos_ids
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stream = StopStringStream(params.stop)
        self.sink = sink
        self.cancelled = False
        self.failure: str | None = None
        self.submitted_s = time.perf_counter()
        self.last_token_s: float | None = None

    def close_text(self) -> str:
        return self.stream.feed(self.detok.flush()) + self.stream.finish()


class LoopObserver(Protocol):
    """What the metrics see (called on the engine thread)."""

    def on_token(self, request: LiveRequest, now: float) -> None: ...

    def on_step(self, steps: Sequence[DecodeStep], *, running: int, waiting: int) -> None: ...

    def on_reuse(self, totals: dict[str, int]) -> None:
        """Running totals of what speculation and the prefix cache saved (`reuse_totals`)."""
        ...


class LiveEngine(SlotEngine):
    """`SlotEngine` with per-request sampling, processors and text (see the module doc)."""

    def __init__(self, model: CausalLM, config: EngineConfig, *, max_len: int) -> None:
        super().__init__(
            model,
            config,
            max_len=max_len,
            params=SamplingParams(),
            eos=set(),
            clock=VirtualClock(model.device),
        )
        self.live: dict[int, LiveRequest] = {}
        self.events: list[tuple[LiveRequest, TokenEvent]] = []
        self.observer: LoopObserver | None = None

    def add(self, live: LiveRequest) -> None:
        request = Request(live.id, live.prompt, live.max_tokens, 0.0)
        self.live[live.id] = live
        self.waiting.append((request, RequestResult(live.id, 0.0, len(live.prompt))))

    def _sample(self, logits: torch.Tensor, rows: Sequence[ActiveRequest]) -> list[int]:
        reqs = [self.live[a.request.id] for a in rows]
        if all(r.params.greedy and not r.processors for r in reqs):
            return logits.argmax(dim=-1).tolist()  # one call for the whole batch
        out = []
        for i, (active, live) in enumerate(zip(rows, reqs, strict=True)):
            row = logits[i : i + 1]
            if live.processors and live.failure is None:
                ids = torch.tensor([[*active.request.prompt, *active.result.tokens]])
                try:
                    row = apply_processors(live.processors, ids.to(row.device), row)
                except QuantkitError as e:  # a grammar dead end fails this request only
                    live.failure = str(e)
            out.append(int(sample(row, live.params, generator=live.generator)[0]))
        return out

    def _spec_sampling(
        self, active: ActiveRequest
    ) -> tuple[SamplingParams, torch.Generator] | None:
        """A request drafts unless it has processors (a grammar or a repetition penalty: they
        need each token's history in turn) or has failed."""
        live = self.live.get(active.request.id)
        if live is None or live.processors or live.failure is not None:
            return None
        return live.params, live.generator

    def reuse_totals(self) -> dict[str, int]:
        """Draft tokens verified and accepted, and prompt tokens the prefix cache served, so
        far."""
        spec, cache = self.spec_stats, self.prefix_cache
        return {
            "drafted": spec.drafted if spec else 0,
            "accepted": spec.accepted if spec else 0,
            "prefix_hit_tokens": cache.stats.hit_tokens if cache else 0,
            "prefix_looked_up_tokens": cache.stats.looked_up_tokens if cache else 0,
        }

    def _emit(self, active: ActiveRequest, token: int, now: float) -> None:
        live, res = self.live[active.request.id], active.result
        finish, text = None, ""
        if live.failure is not None:
            finish = "error"
        elif token in live.eos:
            finish, text = "stop", live.close_text()
        else:
            res.tokens.append(token)
            res.token_times_s.append(now)
            text = live.stream.feed(live.detok.push(token))
            if live.stream.stopped:
                finish = "stop"
            elif len(res.tokens) >= active.request.max_new_tokens:
                text += live.close_text()
                finish = "stop" if live.stream.stopped else "length"
            if self.observer is not None:
                self.observer.on_token(live, time.perf_counter())
        if finish is not None:
            active.done, res.finish_reason, res.finish_s = True, finish, now
        event = TokenEvent(text, finish, len(res.tokens), live.failure)
        self.events.append((live, event))

    def drop_cancelled(self) -> None:
        """Cancelled requests leave the queue now and free their slot at this step's release."""
        if any(self.live[r.id].cancelled for r, _ in self.waiting):
            kept = [(r, res) for r, res in self.waiting if not self.live[r.id].cancelled]
            for r, _ in self.waiting:
                if self.live[r.id].cancelled:
                    self._finish_cancelled(self.live.pop(r.id), 0)
            self.waiting = deque(kept)
        freed = False
        for active in self.occupied():
            live = self.live.get(active.request.id)
            if live is not None and live.cancelled and not active.done:
                active.done, freed = True, True
                active.result.finish_reason = "cancelled"
                self._finish_cancelled(self.live.pop(live.id), len(active.result.tokens))
        if freed:  # now, so that a half-prefilled request is not prefilled further
            self.release()

    def _finish_cancelled(self, live: LiveRequest, tokens: int) -> None:
        self.events.append((live, TokenEvent("", "cancelled", tokens)))

    def step(self) -> list[DecodeStep]:
        """admit, prefill, decode, release; the decode steps it ran."""
        self.admit(self.clock.now())
        self.prefill()
        self.decode()
        for active in self.occupied():
            if active.done:
                self.live.pop(active.request.id, None)
        self.release()
        steps, self.decode_steps = self.decode_steps, []
        self.prefill_chunks.clear()
        return steps

    def busy(self) -> bool:
        return bool(self.waiting or self.occupied())


Deliver = Callable[[list[tuple[LiveRequest, TokenEvent]]], None]


class EngineLoop:
    """The engine on its own thread (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        *,
        max_len: int,
        max_queue: int,
        deliver: Deliver,
        observer: LoopObserver | None = None,
    ) -> None:
        self.model, self.config, self.max_queue = model, config, max_queue
        self.engine = LiveEngine(model, config, max_len=max_len)
        self.engine.observer = observer
        self.observer, self.deliver = observer, deliver
        self._cv = threading.Condition()
        self._inbox: list[LiveRequest] = []
        self._closing = False  # no new requests
        self._stop = False  # cancel what is left and exit
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)

    # -- any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._inbox) + len(self.engine.waiting)

    @property
    def running(self) -> int:
        return sum(a is not None for a in self.engine.slots)

    def submit(self, request: LiveRequest) -> None:
        with self._cv:
            if self._closing or self.error is not None:
                raise ServerError(
                    "the server is shutting down and accepts no new requests",
                    status=503,
                    type="server_error",
                )
            if self.waiting >= self.max_queue:
                raise ServerError(
                    f"the server is busy: {self.waiting} requests are already waiting (the "
                    f"most it queues is {self.max_queue}); retry shortly",
                    status=429,
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self._inbox.append(request)
            self._cv.notify()

    def cancel(self, request: LiveRequest) -> None:
        with self._cv:
            request.cancelled = True
            self._cv.notify()

    def shutdown(self, *, deadline_s: float) -> None:
        """Stop accepting; finish in-flight requests until the deadline; cancel the rest."""
        with self._cv:
            self._closing = True
        end = time.monotonic() + deadline_s
        while self._thread.is_alive() and time.monotonic() < end:
            with self._cv:
                if not self._inbox and not self.engine.busy():
                    break
            time.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # -- the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            with torch.inference_mode():
                engine.install()
                try:
                    while self._once():
                        pass
                finally:
                    self.model.drop_cache()
        except BaseException as e:  # noqa: BLE001 - reported to every request, then kept
            self.error = e
            failed = [*engine.live.values(), *self._inbox]
            self.deliver([(r, TokenEvent("", "error", 0, f"engine failed: {e!r}")) for r in failed])
            raise

    def _once(self) -> bool:
        engine = self.engine
        with self._cv:
            while not self._inbox and not engine.busy() and not self._stop:
                self._cv.wait()
            if self._stop:
                for r in [*self._inbox, *engine.live.values()]:
                    r.cancelled = True
                for r in self._inbox:
                    engine.add(r)
                self._inbox.clear()
                engine.drop_cancelled()
                self._flush()
                return False
            for r in self._inbox:
                engine.add(r)
            self._inbox.clear()
        engine.drop_cancelled()
        steps = engine.step()
        if self.observer is not None:  # before the tokens go out: a client that saw its
            # token and then reads /metrics sees this step's gauges
            self.observer.on_step(steps, running=self.running, waiting=self.waiting)
            self.observer.on_reuse(self.engine.reuse_totals())
        self._flush()
        return True

    def _flush(self) -> None:
        events, self.engine.events = self.engine.events, []
        if events:
            self.deliver(events)
