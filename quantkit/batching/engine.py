"""Continuous batching over `CausalLM`: requests join and leave the running batch at every step.

The engine owns a static KV cache of `batch_cap` slots x `max_len` positions (one slot per
running request; a slot is reused once its request finishes). Each step:

1. requests whose arrival time has passed join the waiting queue (or are rejected when the
   system already holds `admission_limit` requests);
2. free slots take waiting requests, first come first served (static batching: only when the
   whole previous batch has finished, as a server without continuous batching does);
3. prefill: each admitted request's prompt runs into its slot, one forward per request. With
   chunked prefill (`chunk`), at most `chunk` prompt tokens are prefilled per step, so a long
   prompt is split over several steps instead of stalling every running request for its whole
   prefill; a request's first token is sampled when its last chunk is in;
4. decode: one batched forward of every request that has a token to feed, each row at its own
   cache position (rows of different lengths share the step). A request leaves when it hits
   its token limit or an EOS.

Forwards. The cache is a `rows.SlotKV` per layer (every slot's K/V in one store), installed
into each attention layer for the duration of a run. Every forward goes through one interface,
`rows.RowRunner`, picked once at install: `run_rows(tokens, positions, slots)` for a decode step
(the logits of exactly the rows decoding, and the rows computed) and `run_chunk` for a prefill
chunk. Where the model has a one-call decode path (`CausalLM.decode_path`: on a CPU, every layer
of a step in one C call) it is bound once to the whole store (`rows.PathRows`): a step computes
exactly the rows decoding, each at its own slot and position, and cap 1 runs as fast as
`generate` at batch 1. Otherwise `rows.WindowRows` runs the PyTorch layers over slots [0, hi),
hi = 1 + the highest slot being decoded (new requests take the lowest free slot, so the window
stays tight). A slot in that window with nothing to decode (free, still prefilling, or finished
but riding along in a static batch) is fed a dummy token at a position where the write is
harmless (`_fed`): its next prefill position (overwritten by the real K/V before anything reads
it) or 0. Every query attends to its own row's slots <= its position, so a row computes exactly
what it would alone (tested: greedy tokens equal `generate` on each request alone), and the
attention width follows the context actually held.

Time: a virtual clock (`VirtualClock`) that runs with the wall clock while the engine works and
jumps over idle gaps to the next arrival. A request "arrives" when that clock passes its arrival
time, so its TTFT includes the time it queued behind others, and no run waits through idle
seconds. `VirtualClock(step_s=...)` instead advances a fixed amount per forward pass, which makes
the schedule deterministic for tests.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from quantkit.batching.rows import PathRows, RowRunner, SlotKV, WindowRows, round_width
from quantkit.batching.types import (
    DecodeStep,
    EngineConfig,
    PrefillChunk,
    RequestResult,
    RunResult,
    VirtualClock,
)
from quantkit.batching.workload import Request
from quantkit.errors import GenerationError
from quantkit.models.decoder import CausalLM
from quantkit.models.kv_cache import kv_format
from quantkit.runtime.prefix_cache import PrefixCache
from quantkit.runtime.sampling import SamplingParams, make_generator, sample
from quantkit.runtime.speculate import (
    CallTimes,
    DraftPolicy,
    NgramDrafter,
    SpecStats,
    plan_drafts,
)

__all__ = [
    "ActiveRequest",
    "DecodeStep",
    "EngineConfig",
    "PrefillChunk",
    "RequestResult",
    "RunResult",
    "SlotEngine",
    "VirtualClock",
    "run_engine",
]

# Prefill chunks of a batch-invariant run are cut at multiples of this many tokens: the C
# step's GEMVs group a call's rows in eights (AVX-512; fours elsewhere), and a row's sums depend
# on its group's size, so chunks that start on such a boundary give every prompt position the
# group it gets in one whole-prompt call (`generate`'s prefill).
INVARIANT_ALIGN = 8

# --------------------------------------------------------------------------- the engine


class ActiveRequest:
    """A request holding a slot."""

    def __init__(self, request: Request, result: RequestResult, slot: int, order: int) -> None:
        self.request, self.result, self.slot, self.order = request, result, slot, order
        self.prefilled = 0  # prompt tokens in the cache
        self.next_pos = 0  # where the next fed token goes once decoding
        self.done = False

    @property
    def decoding(self) -> bool:
        return bool(self.result.tokens) and not self.done

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)


def _check_requests(requests: Sequence[Request], vocab: int, context: int) -> None:
    if not requests:
        raise GenerationError("requests: expected at least one request, got none")
    for r in requests:
        if not r.prompt:
            raise GenerationError(f"request {r.id}: expected a prompt of >= 1 token, got none")
        if r.max_new_tokens < 1:
            raise GenerationError(
                f"request {r.id}: expected max_new_tokens >= 1, got {r.max_new_tokens}"
            )
        if len(r.prompt) + r.max_new_tokens > context:
            raise GenerationError(
                f"request {r.id}: expected prompt + max_new_tokens <= {context} (the context "
                f"window), got {len(r.prompt)} + {r.max_new_tokens}"
            )
        if not all(0 <= t < vocab for t in r.prompt):
            raise GenerationError(f"request {r.id}: expected token ids in [0, {vocab})")
        if not (r.arrival_s >= 0 and math.isfinite(r.arrival_s)):
            raise GenerationError(
                f"request {r.id}: expected an arrival time >= 0 s, got {r.arrival_s}"
            )


class SlotEngine:
    """The step-level engine: slots, waiting queue, and the four phases of a step (`admit`,
    `prefill`, `decode`, `release`). `run_engine` drives it over a fixed list of requests; the
    HTTP server (`quantkit.http_api`) drives it live, overriding `_sample` (per-request sampling
    and grammar) and `_emit` (streaming, stop strings)."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        *,
        max_len: int,
        params: SamplingParams,
        eos: set[int],
        clock: VirtualClock,
    ) -> None:
        self.model, self.config, self.max_len = model, config, max_len
        self.params, self.eos, self.clock = params, eos, clock
        self.device = model.device
        self.generator = make_generator(params, self.device)
        self.caches: list[SlotKV] = []
        self.rows: RowRunner  # every forward (see install)
        self.slots: list[ActiveRequest | None] = [None] * config.batch_cap
        self.waiting: deque[tuple[Request, RequestResult]] = deque()
        self.decode_steps: list[DecodeStep] = []
        self.prefill_chunks: list[PrefillChunk] = []
        self._order = 0
        budget = int(config.prefix_cache_mb * 2**20)
        self.prefix_cache = PrefixCache(budget) if budget > 0 else None
        self.spec_stats = SpecStats() if config.speculate is not None else None
        self.spec_off: str | None = None  # why speculation was asked for but is off
        self._times = CallTimes()
        self._drafters: dict[int, tuple[NgramDrafter, DraftPolicy]] = {}
        # Prefill chunks this step's decode call takes along (see `_mixes`): (request, start,
        # end) of its prompt.
        self._chunks: list[tuple[ActiveRequest, int, int]] = []

    # -- cache
    def install(self) -> None:
        cfg = self.model.config
        like = self.model.model.embed_tokens.weight
        self.caches = []
        for layer in self.model.model.layers:
            cache = SlotKV(
                self.config.batch_cap,
                self.max_len,
                kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                like=like,
                fmt=kv_format(self.model.kv_dtype, like.dtype),
            )
            layer.self_attn.cache = cache
            self.caches.append(cache)
        self.rows = self._row_runner()
        if self.config.batch_invariant and not isinstance(self.rows, PathRows):
            raise GenerationError(
                "batch invariant: expected a model on the one-call decode path (the C step), "
                "got the PyTorch layers"
            )
        if self.config.speculate is not None:
            if self.config.mode != "continuous":
                self.spec_off = "static batching decodes whole batches in lockstep"
            elif not isinstance(self.rows, PathRows):
                self.spec_off = "no one-call decode path (the C step) to verify drafts on"

    def _kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [c.store_k for c in self.caches], [c.store_v for c in self.caches]

    def _row_runner(self) -> RowRunner:
        """What runs every forward of this run, picked once: the model's one-call decode path
        (`CausalLM.decode_path`) bound to the store of every slot where it binds, else the
        PyTorch layers over a window of slots (also the path's runner of long prefill chunks)."""
        window = WindowRows(self.model, self.caches, self.max_len, self._idle)
        path = self.model.decode_path
        if path is None:
            return window
        for cache in self.caches:
            cache.select_all()
        bound = path.unbound()
        bound.bind(self.model)
        return window if bound.step is None else PathRows(self.model, bound, window)

    # -- token bookkeeping
    def _emit(self, active: ActiveRequest, token: int, now: float) -> None:
        res = active.result
        if token in self.eos:
            active.done, res.finish_reason, res.finish_s = True, "stop", now
            return
        res.tokens.append(token)
        res.token_times_s.append(now)
        if len(res.tokens) >= active.request.max_new_tokens:
            active.done, res.finish_reason, res.finish_s = True, "length", now

    def _sample(self, logits: torch.Tensor, rows: Sequence[ActiveRequest]) -> list[int]:
        """One token per row of logits [R, V]; rows[r] is the request row r belongs to (unused
        here: every request shares one `params` and generator)."""
        return sample(logits, self.params, generator=self.generator).tolist()

    def _spec_sampling(
        self, active: ActiveRequest
    ) -> tuple[SamplingParams, torch.Generator] | None:
        """How a request that may draft samples (speculation accepts with these), or None when
        it may not (its tokens then come from `_sample`, one a step)."""
        return self.params, self.generator

    # -- scheduling
    def occupied(self) -> list[ActiveRequest]:
        return [a for a in self.slots if a is not None]

    def admit(self, now: float) -> None:
        if self.config.mode == "static" and self.occupied():
            return
        for i, holder in enumerate(self.slots):
            if holder is None and self.waiting:
                request, result = self.waiting.popleft()
                result.admitted_s = now
                self.slots[i] = ActiveRequest(request, result, i, self._order)
                self._order += 1

    def release(self) -> None:
        if self.config.mode == "static":
            if all(a.done for a in self.occupied()):
                self.slots = [None] * self.config.batch_cap
            return
        self.slots = [None if a is not None and a.done else a for a in self.slots]

    # -- forwards
    def _mixes(self) -> bool:
        """Whether this step's prefill chunks ride in its decode call instead of calls of their
        own: on the one-call C path, which takes rows of any slots at any positions in one call
        (a chunk is rows of one slot at consecutive positions), so the weights are read once
        for both; as llama.cpp's server batches prompts with decode tokens. Not with batch
        invariance (a chunk's rows must group as a whole prefill's do), static batching, nor
        while speculating (a verification call has its own rows)."""
        speculating = self.config.speculate is not None and self.spec_off is None
        return (
            isinstance(self.rows, PathRows)
            and self.config.mode == "continuous"
            and not self.config.batch_invariant
            and not speculating
        )

    def prefill(self) -> None:
        budget = self.config.chunk or math.inf
        mixes = self._mixes()
        for active in sorted((a for a in self.occupied() if a.prefilling), key=lambda a: a.order):
            if budget <= 0:
                break
            prompt = active.request.prompt
            if active.prefilled == 0 and self.prefix_cache is not None:
                hit = self.prefix_cache.match(prompt)
                if hit:
                    self.prefix_cache.load(prompt, hit, *self._kv(), active.slot)
                    active.prefilled = hit
            start = active.prefilled
            n = int(min(len(prompt) - start, budget))
            if self.config.batch_invariant and start + n < len(prompt):
                n -= n % INVARIANT_ALIGN  # chunks start where a whole prefill's row groups do
                if n == 0:
                    break
            budget -= n
            end = start + n
            if mixes and n <= self.rows.max_rows:
                self._chunks.append((active, start, end))  # run by `decode`, with its rows
                continue
            began = self.clock.now()
            logits = self.rows.run_chunk(active.slot, prompt[start:end], start)
            active.prefilled = end
            if end == len(prompt):
                self._prompt_in(active)
                token = self._sample(logits, [active])[0]
                self.clock.forward_done()
                self._emit(active, token, self.clock.now())
            else:
                self.clock.forward_done()
            self.prefill_chunks.append(PrefillChunk(n, end, self.clock.now() - began))

    def _prompt_in(self, active: ActiveRequest) -> None:
        """A request's whole prompt is in its slot: keep its prefix blocks (with a prefix
        cache) and feed its next token after the prompt."""
        prompt = active.request.prompt
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt, *self._kv(), active.slot)
        active.next_pos = len(prompt)

    def _fed(self, active: ActiveRequest | None) -> tuple[int, int]:
        """(token, position) a slot feeds to a decode step. A slot with nothing to decode (free
        or finished: token 0 at position 0; still prefilling: its next prompt position, which
        its next chunk overwrites before anything reads it) makes a harmless write: a static
        batch computes its finished rows as such a server does, and a `WindowRows` step covers
        every slot under the highest one decoded (`_idle`)."""
        if active is None or active.done:
            return 0, 0
        if active.decoding:
            return active.result.tokens[-1], active.next_pos
        return 0, active.prefilled

    def _idle(self, slot: int) -> tuple[int, int]:
        """(token, position) a slot not asked for feeds to a window's decode step."""
        return self._fed(self.slots[slot])

    def decode(self) -> None:
        rows = [a for a in self.occupied() if a.decoding]
        if self._chunks:
            self._decode_mixed(rows)
            return
        if not rows:
            return
        if self.config.speculate is not None and self.spec_off is None:
            self._decode_speculative(rows)
            return
        span = self.occupied() if self.config.mode == "static" else rows
        began = self.clock.now()
        fed = [self._fed(a) for a in span]
        slots = [a.slot for a in span]
        logits, window = self.rows.run_rows(
            [t for t, _ in fed], [p for _, p in fed], slots,
            row_invariant=self.config.batch_invariant,
        )  # fmt: skip
        sampled = dict(zip(slots, self._sample(logits, span), strict=True))
        self.clock.forward_done()
        now = self.clock.now()
        context = sum(a.next_pos + 1 for a in rows)
        for a in rows:
            a.next_pos += 1
            self._emit(a, sampled[a.slot], now)
        self.decode_steps.append(DecodeStep(len(rows), window, context, now - began))

    def _decode_mixed(self, rows: list[ActiveRequest]) -> None:
        """One call for the decode rows and the prefill chunks `prefill` left (`_mixes`): each
        decode row gets its next token; a chunk that ends its prompt gets the request's first
        token (the request decodes from the next step on)."""
        assert isinstance(self.rows, PathRows)
        chunks, self._chunks = self._chunks, []
        began = self.clock.now()
        fed = [self._fed(a) for a in rows]
        tokens, positions = [t for t, _ in fed], [p for _, p in fed]
        slots = [a.slot for a in rows]
        logit_rows = list(range(len(rows)))
        first: list[ActiveRequest] = []  # prompts that end in this call
        for active, start, end in chunks:
            prompt = active.request.prompt
            tokens += prompt[start:end]
            positions += range(start, end)
            slots += [active.slot] * (end - start)
            if end == len(prompt):
                first.append(active)
                logit_rows.append(len(tokens) - 1)
        logits = self.rows.run_mixed(tokens, positions, slots, logit_rows)
        sampled = self._sample(logits, rows + first) if logit_rows else []
        self.clock.forward_done()
        now = self.clock.now()
        for active, start, end in chunks:
            active.prefilled = end
            self.prefill_chunks.append(PrefillChunk(end - start, end, now - began))
        context = sum(a.next_pos + 1 for a in rows)
        for active in rows:
            active.next_pos += 1
        for active in first:
            self._prompt_in(active)
        for active, token in zip(rows + first, sampled, strict=True):
            self._emit(active, token, now)
        if rows:
            step = DecodeStep(len(rows), len(slots), context, now - began, len(tokens) - len(rows))
            self.decode_steps.append(step)

    def _decode_speculative(self, rows: list[ActiveRequest]) -> None:
        """A decode step where each request may feed drafted tokens after its last one
        (`runtime.speculate`): the draft lengths are planned for the whole step
        (`plan_drafts`), every row of a step with drafts runs row-invariant (each exactly as
        decoded alone), and each request keeps its accepted drafts plus one token."""
        config, stats = self.config.speculate, self.spec_stats
        assert config is not None and stats is not None
        began = self.clock.now()
        policies, proposals, available = [], [], []
        samplings = [self._spec_sampling(a) for a in rows]
        for a, sampling in zip(rows, samplings, strict=True):
            proposal: list[int] = []
            entry = self._drafters.get(a.request.id)
            if sampling is not None:
                if entry is None:
                    tokens = [*a.request.prompt, *a.result.tokens]
                    entry = (NgramDrafter(tokens, config), DraftPolicy(config, self._times))
                    self._drafters[a.request.id] = entry
                proposal = entry[0].propose(config.k)
            policies.append(entry[1] if entry else DraftPolicy(config, self._times))
            proposals.append(proposal)
            left = a.request.max_new_tokens - len(a.result.tokens) - 1
            available.append(max(0, min(len(proposal), left)))
        plan = plan_drafts(policies, available, self._times)
        fed: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for a, j, proposal in zip(rows, plan, proposals, strict=True):
            tokens = [a.result.tokens[-1], *proposal[:j]]
            fed += tokens
            positions += range(a.next_pos, a.next_pos + len(tokens))
            slots += [a.slot] * len(tokens)
        verify = any(plan) or self.config.batch_invariant
        t0 = time.perf_counter()
        logits, window = self.rows.run_rows(fed, positions, slots, row_invariant=verify)
        self._times.add(len(fed), time.perf_counter() - t0, verify=verify)
        outs: list[tuple[list[int], int]] = []
        at = 0
        for a, j, proposal, policy, sampling in zip(
            rows, plan, proposals, policies, samplings, strict=True
        ):
            rows_of = logits[at : at + j + 1]
            at += j + 1
            if sampling is None:
                outs.append((self._sample(rows_of, [a]), 0))
                continue
            params, generator = sampling
            outs.append(policy.judge(rows_of, proposal[:j], proposal, params, generator=generator))
        self.clock.forward_done()
        now = self.clock.now()
        context = sum(a.next_pos + 1 for a in rows)
        for a, j, (out, n) in zip(rows, plan, outs, strict=True):
            emitted = 0
            for token in out:
                self._emit(a, token, now)
                emitted += 1
                if a.done:
                    break
            a.next_pos += n + 1
            stats.record(j, n, emitted)
            entry = self._drafters.get(a.request.id)
            if a.done:
                self._drafters.pop(a.request.id, None)
            elif entry is not None:
                entry[0].extend(out[:emitted])
        self.decode_steps.append(DecodeStep(len(rows), window, context, now - began))

    def spec_summary(self) -> dict[str, object] | None:
        if self.spec_stats is None:
            return None
        summary: dict[str, object] = dict(self.spec_stats.as_dict())
        if self.spec_off is not None:
            summary["off"] = self.spec_off
        return summary

    def prefix_summary(self) -> dict[str, object] | None:
        cache = self.prefix_cache
        if cache is None:
            return None
        return {**cache.stats.as_dict(), "bytes": cache.bytes, "budget_bytes": cache.budget_bytes}


@torch.inference_mode()
def run_engine(
    model: CausalLM,
    requests: Sequence[Request],
    config: EngineConfig,
    *,
    params: SamplingParams | None = None,
    eos_ids: Iterable[int] = (),
    clock: VirtualClock | None = None,
    max_len: int | None = None,
) -> RunResult:
    """Serve `requests` (each arriving at its own time) and return what happened to each.

    params: sampling (default greedy). Its max_new_tokens is ignored (each request has its
        own); repetition penalty and stop strings are not supported here.
    eos_ids: tokens that end a request early (a serving benchmark passes none, so that every
        request produces exactly its max_new_tokens).
    clock: default `VirtualClock(model.device)`, started now.
    max_len: cache positions per slot (default: the longest request, rounded up).
    """
    params = params or SamplingParams()
    if params.repetition_penalty != 1.0 or params.stop:
        raise GenerationError(
            "sampling: expected no repetition penalty and no stop strings (the engine does not "
            f"keep per-request history), got repetition_penalty={params.repetition_penalty}, "
            f"stop={params.stop!r}"
        )
    cfg = model.config
    _check_requests(requests, cfg.vocab_size, cfg.max_position_embeddings)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    if max_len is None:
        max_len = round_width(longest, cfg.max_position_embeddings)
    if not longest <= max_len:
        raise GenerationError(
            f"max_len: expected >= {longest} positions for these requests, got {max_len}"
        )
    clock = clock or VirtualClock(model.device)
    engine = SlotEngine(
        model, config, max_len=max_len, params=params, eos=set(eos_ids), clock=clock
    )
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.id)))
    results = {r.id: RequestResult(r.id, r.arrival_s, len(r.prompt)) for r in requests}
    if len(results) != len(requests):
        raise GenerationError("requests: expected unique ids, got duplicates")
    clock.skip_to(pending[0].arrival_s)
    engine.install()
    try:
        while pending or engine.waiting or engine.occupied():
            now = clock.now()
            while pending and pending[0].arrival_s <= now:
                request = pending.popleft()
                result = results[request.id]
                in_system = len(engine.waiting) + len(engine.occupied())
                limit = config.admission_limit
                if limit is not None and in_system >= limit:
                    result.finish_reason, result.finish_s = "rejected", now
                    continue
                engine.waiting.append((request, result))
            if not engine.waiting and not engine.occupied():
                if pending:
                    clock.skip_to(pending[0].arrival_s)
                continue
            engine.admit(now)
            engine.prefill()
            engine.decode()
            engine.release()
    finally:
        model.drop_cache()
    done = [r for r in results.values() if r.token_times_s]
    end = max((r.token_times_s[-1] for r in done), default=clock.now())
    return RunResult(
        requests=[results[r.id] for r in requests],
        decode_steps=engine.decode_steps,
        prefill_chunks=engine.prefill_chunks,
        config=config,
        start_s=min(r.arrival_s for r in requests),
        end_s=end,
        speculation=engine.spec_summary(),
        prefix_cache=engine.prefix_summary(),
    )
