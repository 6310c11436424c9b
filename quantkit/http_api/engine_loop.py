"""One thread owns the model: HTTP handlers submit requests, the loop steps the engine and hands
each step's tokens back.

`LiveEngine` is the serving engine (`quantkit.batching.engine.SlotEngine`: slots, waiting queue,
chunked prefill, one batched decode per step) with what a server needs on top: every request
samples with its own parameters and `torch.Generator` (so a seeded request gives the same text
whatever it is batched with) and its own logits processors (a grammar for `response_format`, a
repetition penalty), and turns its tokens into text as they come (incremental detokenization,
stop strings held back until they cannot match). A request that asks for logprobs gets each
generated token's (`quantkit.runtime.scoring`: the log-softmax of the model's logits, before
its processors and temperature) with its event, and does not draft (speculation's accepted
tokens carry no per-token distribution here).

`EngineLoop` runs it on a thread of its own:

- `submit` (any thread) queues a request, or raises a 429 `ServerError` when `max_queue`
  requests are already waiting, or a 503 once the loop is shutting down;
- `cancel` (any thread) marks a request; the next step drops it from the queue or frees its slot;
- `call` (any thread) runs a function of the model on the engine thread between two steps, with
  the engine's slot caches set aside (prompt scoring: `scoring.prompt_logprobs`), and returns a
  `concurrent.futures.Future` of its result;
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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
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
from quantkit.runtime.scoring import TokenLogprob, log_probs, token_logprob
from quantkit.runtime.textstream import IncrementalDetokenizer, StopStringStream

__all__ = ["EngineLoop", "LiveRequest", "LoopObserver", "TokenEvent"]

_ids = itertools.count()


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request. text: what became final ("" while held back); finish_reason:
    on the last event, "stop" (EOS or a stop string), "length", "cancelled" or "error";
    completion_tokens: generated so far (EOS excluded); logprobs: the generated token's, when
    the request asked for them, the EOS that ends a completion included (as vLLM returns it:
    lm-eval's local-completions drops the last logprob, expecting its one generated token)."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


class LiveRequest:
    """A request as the engine thread sees it. `sink` belongs to whoever submitted it (the app
    keeps its asyncio queue there); the loop never touches it. `logprobs`: None = off, else
    each generated token's log-probability comes with the `logprobs` most likely tokens."""

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
        logprobs: int | None = None,
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
        self.logprobs = logprobs
        self.sampled: TokenLogprob | None = None  # the last sampled token's, until emitted
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
            out = logits.argmax(dim=-1).tolist()  # one call for the whole batch
        else:
            out = self._sample_rows(logits, rows, reqs)
        for i, (live, token) in enumerate(zip(reqs, out, strict=True)):
            if live.logprobs is not None:
                live.sampled = token_logprob(log_probs(logits[i]), token, live.logprobs)
        return out

    def _sample_rows(
        self, logits: torch.Tensor, rows: Sequence[ActiveRequest], reqs: list[LiveRequest]
    ) -> list[int]:
        """Each row with its request's processors, parameters and generator."""
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
        """A request drafts unless it has processors (a grammar or a penalty: they need each
        token's history in turn), asks for logprobs, or has failed."""
        live = self.live.get(active.request.id)
        if live is None or live.processors or live.failure is not None:
            return None
        if live.logprobs is not None:
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
        finish, text, logprobs = None, "", ()
        sampled, live.sampled = live.sampled, None
        if live.failure is not None:
            finish = "error"
        elif token in live.eos:
            finish, text = "stop", live.close_text()
            if sampled is not None and sampled.token == token:
                logprobs = (sampled,)
        else:
            res.tokens.append(token)
            res.token_times_s.append(now)
            if sampled is not None and sampled.token == token:
                logprobs = (sampled,)
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
        event = TokenEvent(text, finish, len(res.tokens), live.failure, logprobs)
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

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """The model without the engine's slot caches for a while (a forward with a cache of its
        own, `setup_cache` and `drop_cache`), then the same caches back: the engine's runners
        check them by identity, so they go on as if nothing ran."""
        layers = self.model.model.layers
        kept = [layer.self_attn.cache for layer in layers]
        try:
            for layer in layers:
                layer.self_attn.cache = None
            yield
        finally:
            for layer, cache in zip(layers, kept, strict=True):
                layer.self_attn.cache = cache


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
        self._jobs: list[tuple[Callable[[CausalLM], Any], Future[Any]]] = []
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

    def _check_open(self) -> None:
        """A 503 once the loop is shutting down (or has failed); call it holding `_cv`."""
        if self._closing or self.error is not None:
            raise ServerError(
                "the server is shutting down and accepts no new requests",
                status=503,
                type="server_error",
            )

    def submit(self, request: LiveRequest) -> None:
        with self._cv:
            self._check_open()
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

    def call(self, fn: Callable[[CausalLM], Any]) -> Future[Any]:
        """Run `fn(model)` on the engine thread before its next step, the slot caches set aside
        (`LiveEngine.set_aside`); a 503 `ServerError` once the loop is shutting down."""
        future: Future[Any] = Future()
        with self._cv:
            self._check_open()
            self._jobs.append((fn, future))
            self._cv.notify()
        return future

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
            with self._cv:
                jobs, self._jobs = self._jobs, []
            for _, future in jobs:
                future.set_exception(
                    ServerError(f"engine failed: {e!r}", status=500, type="server_error")
                )
            raise

    def _once(self) -> bool:
        engine = self.engine
        with self._cv:
            while not self._inbox and not self._jobs and not engine.busy() and not self._stop:
                self._cv.wait()
            jobs, self._jobs = self._jobs, []
            if self._stop:
                for _, future in jobs:
                    future.set_exception(
                        ServerError("the server is shutting down", status=503, type="server_error")
                    )
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
        for fn, future in jobs:
            self._run_job(fn, future)
        engine.drop_cancelled()
        steps = engine.step()
        if self.observer is not None:  # before the tokens go out: a client that saw its
            # token and then reads /metrics sees this step's gauges
            self.observer.on_step(steps, running=self.running, waiting=self.waiting)
            self.observer.on_reuse(self.engine.reuse_totals())
        self._flush()
        return True

    def _run_job(self, fn: Callable[[CausalLM], Any], future: Future[Any]) -> None:
        """One `call`: its exception (a bad prompt, out of memory) fails that call only."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            with self.engine.set_aside():
                result = fn(self.model)
        except Exception as e:  # noqa: BLE001 - handed to the caller, the engine goes on
            future.set_exception(e)
        else:
            future.set_result(result)

    def _flush(self) -> None:
        events, self.engine.events = self.engine.events, []
        if events:
            self.deliver(events)
