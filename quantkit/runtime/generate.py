"""The decode loop, after gpt-fast: `prefill`, `decode_one_token`, `generate`.

Batches of different prompt lengths use right padding with per-row positions: row b's prompt
sits at cache slots 0..L_b-1 (its pad tokens, written at L_b..Lmax-1, are overwritten by its
own generated tokens before any query can see them), its n-th generated token is fed at slot
L_b + n, and each query attends to slots <= its own position. So a row computes exactly what it
would alone, and RoPE positions equal cache slots, as `CausalLM` requires.

Rows that finish early (EOS, a stop string, their token limit) keep riding along in the static
batch, frozen at their last slot, until every row is done; their outputs are discarded.

Fast-forward (`fast_forward=True`, batch 1): a processor with a `forced_tokens(row, token, *,
limit)` method (the grammar's) names the tokens its constraint forces after each sampled token;
they are appended without sampling and fed together with that token in one model call of
several rows (on a CPU, the C step's multi-row call that prefill uses). Off, nothing changes.

What is timed (see `quantkit.runtime.stats`): TTFT = prefill + sampling + handling of the first
token; then one latency per decode step, each including its sampling and the detokenization and
callback of its tokens, so TTFT + the steps add up to the wall time of the call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import GenerationError
from quantkit.models.decoder import CausalLM
from quantkit.runtime.prefix_cache import PrefixCache
from quantkit.runtime.sampling import (
    LogitsProcessor,
    SamplingParams,
    apply_processors,
    default_processors,
    greedy_list,
    make_generator,
    sample,
)
from quantkit.runtime.speculate import (
    DraftPolicy,
    NgramDrafter,
    SpecConfig,
    SpecStats,
    verify_logits,
)
from quantkit.runtime.stats import GenerationStats, Timer
from quantkit.runtime.textstream import IncrementalDetokenizer, StopStringStream

__all__ = [
    "GenerationResult",
    "StreamEvent",
    "cache_length",
    "decode_one_token",
    "encode_prompt",
    "eos_token_ids",
    "generate",
    "prefill",
]

# Cache lengths are rounded up to this many slots, so a compiled decode step (static shapes)
# is reused across calls whose lengths differ a little. Masked slots cost one dot product each.
_CACHE_ROUND = 64


@dataclass(frozen=True)
class StreamEvent:
    """One step of one row, for streaming.

    token: the generated token, or None on a closing event that adds no token (EOS).
    text: the text that became final with this event ("" while held back: an unfinished
        character, or a tail that may turn into a stop string).
    finish_reason: "stop" or "length" on the row's last event, else None.
    """

    row: int
    token: int | None
    text: str
    finish_reason: str | None


@dataclass
class GenerationResult:
    """tokens: generated ids per row (EOS excluded; a stop string's tokens included).
    texts: the decoded text per row, cut before its stop string (None without a tokenizer).
    finish_reasons: "stop" (EOS or a stop string) or "length" (the token limit) per row."""

    tokens: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    stats: GenerationStats


# --------------------------------------------------------------------------- model steps


def prefill(
    model: CausalLM, ids: torch.Tensor, *, lengths: torch.Tensor, start: int = 0
) -> torch.Tensor:
    """Run right-padded prompts ids [B, T] (row b real up to lengths[b]) into the cache at slots
    0..T-1; return the next-token logits [B, V] of each row's last real token. start: the
    first `start` positions are in the cache already (a prefix cache hit): only the rest runs."""
    b, t = ids.shape
    slots = model.model.layers[0].self_attn.cache.k.shape[2]
    positions = torch.arange(start, t, device=ids.device).expand(b, t - start)
    # Causal over the cache: query t sees slots <= t; the same for every row.
    mask = (torch.arange(slots, device=ids.device) <= positions[:1, :, None]).unsqueeze(1)
    logits = model(ids[:, start:], positions=positions, mask=mask, logits_at=lengths - 1 - start)
    return logits[:, 0]


def decode_one_token(
    model: CausalLM, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Feed tokens [B, 1] at cache slots positions [B, 1] under mask [B, 1, 1, S]; return the
    next-token logits [B, V]. The hot step: this is what `compile=True` compiles."""
    return model(tokens, positions=positions, mask=mask)[:, -1]


def _decode_step(device: torch.device, *, compile: bool) -> Callable[..., torch.Tensor]:
    if not compile:
        return decode_one_token
    # CUDA graphs replay the whole step as one launch (small-batch decode is launch-bound);
    # on CPU inductor fuses the elementwise ops between the matmuls. Dynamo caches the result
    # on decode_one_token's code object, so later calls with the same shapes reuse it.
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(decode_one_token, mode=mode, dynamic=False)


# --------------------------------------------------------------------------- prompts


def encode_prompt(tokenizer: Any, text: str, *, chat: bool | None = None) -> list[int]:
    """Token ids of `text`; as one user turn of the tokenizer's chat template when `chat` (None:
    when the tokenizer has a template, as instruct models do)."""
    if not text.strip():
        raise GenerationError("prompt: expected some text, got an empty prompt")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        chat = has_template
    if chat:
        if not has_template:
            raise GenerationError(
                "chat: expected a tokenizer with a chat template, got one without (use --no-chat)"
            )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        # The template already holds the special tokens; adding them again would double BOS.
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))


def eos_token_ids(
    *, tokenizer: Any = None, config: dict[str, Any] | None = None, model_dir: Path | None = None
) -> set[int]:
    """Every id that ends a sequence: the tokenizer's eos, config.json's and
    generation_config.json's `eos_token_id` (an int or a list in either file)."""
    found: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    if config is not None:
        add(config.get("eos_token_id"))
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        try:
            add(
                json.loads((Path(model_dir) / "generation_config.json").read_text()).get(
                    "eos_token_id"
                )
            )
        except (OSError, json.JSONDecodeError):  # a broken optional file is not worth an error
            pass
    return found


def cache_length(lengths: Sequence[int], max_new_tokens: int, *, context: int) -> int:
    """The KV cache slots `generate` allocates by default: room for the longest row (prompt +
    new tokens, within the context window), rounded up to a multiple of 64."""
    needed = max(min(n + max_new_tokens, context) for n in lengths)
    return min(context, -(-needed // _CACHE_ROUND) * _CACHE_ROUND)


# --------------------------------------------------------------------------- per-row state


class _Row:
    """One sequence's output: tokens, text, and why it stopped."""

    def __init__(
        self, index: int, limit: int, *, tokenizer: Any, stop: tuple[str, ...], eos: set[int]
    ) -> None:
        self.index, self.limit, self.eos = index, limit, eos
        self.tokens: list[int] = []
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stream = StopStringStream(stop)
        self.finish_reason: str | None = None

    def add(self, token: int) -> StreamEvent:
        if token in self.eos:
            self.finish_reason = "stop"
            return StreamEvent(self.index, None, self._close(), "stop")
        self.tokens.append(token)
        text = self.stream.feed(self.detok.push(token)) if self.detok is not None else ""
        if self.stream.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"
            text += self._close()
            if self.stream.stopped:  # the released tail completed a stop string
                self.finish_reason = "stop"
        return StreamEvent(self.index, token, text, self.finish_reason)

    def _close(self) -> str:
        text = self.stream.feed(self.detok.flush()) if self.detok is not None else ""
        return text + self.stream.finish()


# --------------------------------------------------------------------------- generate


def _check_prompts(prompts: Sequence[Sequence[int]], vocab: int, context: int) -> list[int]:
    if not prompts:
        raise GenerationError("prompts: expected at least one prompt, got none")
    lengths = []
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise GenerationError(f"prompt {i}: expected at least one token, got an empty prompt")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise GenerationError(f"prompt {i}: expected token ids in [0, {vocab}), got {bad[0]}")
        if len(prompt) >= context:
            raise GenerationError(
                f"prompt {i}: expected at most {context - 1} tokens (context window {context}, "
                f"one slot left to generate), got {len(prompt)}"
            )
        lengths.append(len(prompt))
    return lengths


def _check_options(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    processors: Sequence[LogitsProcessor],
    *,
    tokenizer: Any,
    speculate: SpecConfig | None,
) -> None:
    """Refuse option combinations `generate` cannot honour, before any work starts."""
    if params.stop and tokenizer is None:
        raise GenerationError("stop strings: expected a tokenizer to decode text, got none")
    if speculate is not None and (len(prompts) > 1 or processors):
        raise GenerationError(
            "speculate: expected one prompt and no logits processors (a grammar's state "
            f"advances once per step), got {len(prompts)} prompts and {len(processors)} "
            "processors"
        )


def _cache_slots(
    lengths: list[int],
    limits: list[int],
    max_new_tokens: int,
    *,
    context: int,
    cache_len: int | None,
) -> int:
    """The KV cache slots to allocate: `cache_length`'s default, or `cache_len` once checked
    to hold every row's prompt and token limit within the context window."""
    slots = cache_length(lengths, max_new_tokens, context=context)
    if cache_len is not None:
        needed = max(n + k for n, k in zip(lengths, limits, strict=True))
        if not needed <= cache_len <= context:
            raise GenerationError(
                f"cache_len: expected {needed} to {context} slots for these prompts and "
                f"max_new_tokens, got {cache_len}"
            )
        slots = cache_len
    return slots


def _prompt_tensors(
    prompts: Sequence[Sequence[int]],
    lengths: list[int],
    limits: list[int],
    device: torch.device,
    *,
    keep_history: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The right-padded prompt ids [B, Lmax], the prompt lengths [B], and (when there are
    processors to feed) the right-aligned history [B, Lmax + max limit], -1 where empty."""
    batch, longest = len(prompts), max(lengths)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : lengths[i]] = torch.tensor([int(t) for t in prompt])
    ids = ids.to(device)
    length_t = torch.tensor(lengths, device=device)
    # Right-aligned history for the processors (only kept when there are some).
    history = None
    if keep_history:
        history = torch.full((batch, longest + max(limits)), -1, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            history[i, longest - lengths[i] : longest] = torch.tensor([int(t) for t in prompt])
        history = history.to(device)
    return ids, length_t, history


class _Sampler:
    """Turns each step's logits into tokens and hands them to the rows: the processors'
    history (its filled `width` grows by one column per step, more when tokens are forced),
    the sampling RNG, the streaming callback, and fast-forward's forced tokens."""

    def __init__(
        self,
        rows: list[_Row],
        params: SamplingParams,
        *,
        chain: list[LogitsProcessor],
        history: torch.Tensor | None,
        width: int,
        generator: torch.Generator,
        on_token: Callable[[StreamEvent], None] | None,
        forcer: Any,  # a processor with `forced_tokens`, or None: fast-forward off
        device: torch.device,
    ) -> None:
        self.rows, self.params, self.chain, self.history = rows, params, chain, history
        self.width, self.generator, self.on_token = width, generator, on_token
        self.forcer, self.device = forcer, device
        # A CPU history is written through a NumPy view of it: after the decode step has
        # streamed the weights through the caches, each torch call here cost 7-12 us cold
        # (the record of a step, three of them, 27-33 us inside `generate`).
        cpu = history is not None and history.device.type == "cpu"
        self._written = history.numpy() if cpu else None

    def pick(self, logits: torch.Tensor) -> list[int]:
        """One token per row from logits [B, V], after the processors; a finished row's
        token (discarded) goes into the history as -1."""
        history = self.history
        if history is not None:
            logits = apply_processors(self.chain, history[:, : self.width], logits)
        if self.params.greedy:
            tokens = greedy_list(logits)
        else:
            tokens = sample(logits, self.params, generator=self.generator).tolist()
        if history is not None:
            column = [-1 if r.finish_reason is not None else t
                      for r, t in zip(self.rows, tokens, strict=True)]  # fmt: skip
            self._write((slice(None), self.width), column)
            self.width += 1
        return tokens

    def _write(self, at: tuple[Any, Any], tokens: list[int]) -> None:
        """`tokens` into the history at `at` (an index of it)."""
        if self._written is not None:
            self._written[at] = tokens
        else:
            assert self.history is not None
            self.history[at] = torch.tensor(tokens, device=self.device)

    def handle(self, tokens: list[int]) -> None:
        """Give each unfinished row its token and stream the event."""
        for row, token in zip(self.rows, tokens, strict=True):
            if row.finish_reason is None:
                event = row.add(token)
                if self.on_token is not None:
                    self.on_token(event)

    def forced_after(self, token: int) -> list[int]:
        """The tokens forced after row 0's `token`, already handled and in the history."""
        row = self.rows[0]
        if self.forcer is None or row.finish_reason is not None:
            return []
        forced = self.forcer.forced_tokens(0, token, limit=row.limit - len(row.tokens))
        kept: list[int] = []
        for t in forced:
            if row.finish_reason is not None:  # a stop string ended it: feed no more
                break
            self.handle([t])
            kept.append(t)
        if kept and self.history is not None:
            self._write((0, slice(self.width, self.width + len(kept))), kept)
            self.width += len(kept)
        return kept


@dataclass
class _Timings:
    """What one `generate` call measured, for its `GenerationStats`."""

    ttft: float
    latencies: list[float]
    wall: float
    prefix_start: int  # prompt positions every row took from the prefix cache
    speculation: SpecStats | None


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    processors: Sequence[LogitsProcessor] = (),
    eos_ids: Iterable[int] = (),
    tokenizer: Any = None,
    on_token: Callable[[StreamEvent], None] | None = None,
    compile: bool = False,
    generator: torch.Generator | None = None,
    cache_len: int | None = None,
    fast_forward: bool = False,
    speculate: SpecConfig | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationResult:
    """Generate up to `params.max_new_tokens` tokens after each prompt (token ids), batched.

    processors: run after the ones `params` implies (repetition penalty), in order. They get
        input_ids [B, T] right-aligned (the last column is each row's newest token; -1 fills
        the left of shorter rows, and is the newest token of a row that already finished).
    eos_ids: tokens that end a row (see `eos_token_ids`); not part of the output.
    tokenizer: needed for texts and stop strings; on_token: called with every `StreamEvent`.
    compile: torch.compile the decode step (CUDA graphs on GPU); the first call compiles.
    generator: the sampling RNG (default: one seeded with params.seed on the model's device).
    cache_len: slots of the static KV cache (default: see `cache_length`). A compiled step is
        specialized to it, so a warm-up run that should compile for a later call passes the
        later call's `cache_length(...)`.
    fast_forward: append the tokens a processor forces without sampling (batch 1 only; see
        the module docstring); a batch of several rows decodes as without it.
    speculate: prompt-lookup speculative decoding (`runtime.speculate`), one prompt at a time;
        greedy output is token-identical to plain decoding, sampled output has the same
        distribution. Not with `processors` (a grammar keeps state per step).
    prefix_cache: reuse the K/V of prompt prefixes seen by earlier calls with this cache, and
        add this call's prompts to it (`runtime.prefix_cache`).
    A row's token limit is also capped by the context window (finish reason "length").
    """
    cfg, device = model.config, model.device
    context = cfg.max_position_embeddings
    lengths = _check_prompts(prompts, cfg.vocab_size, context)
    _check_options(prompts, params, processors, tokenizer=tokenizer, speculate=speculate)
    chain = [*default_processors(params), *processors]
    generator = generator or make_generator(params, device)
    eos = set(eos_ids)
    batch = len(prompts)
    limits = [min(params.max_new_tokens, context - n) for n in lengths]
    slots = _cache_slots(
        lengths, limits, params.max_new_tokens, context=context, cache_len=cache_len
    )
    rows = [
        _Row(i, limits[i], tokenizer=tokenizer, stop=params.stop, eos=eos) for i in range(batch)
    ]
    ids, length_t, history = _prompt_tensors(
        prompts, lengths, limits, device, keep_history=bool(chain)
    )
    forcer = None
    if fast_forward and batch == 1:
        forcer = next((p for p in processors if hasattr(p, "forced_tokens")), None)
    sampler = _Sampler(
        rows, params, chain=chain, history=history, width=max(lengths), generator=generator,
        on_token=on_token, forcer=forcer, device=device,
    )  # fmt: skip
    step = _decode_step(device, compile=compile)
    model.setup_cache(batch=batch, max_len=slots)
    try:
        timings = _run(
            model, prompts, sampler, ids, length_t, step=step, slots=slots,
            speculate=speculate, prefix_cache=prefix_cache,
        )  # fmt: skip
    finally:
        model.drop_cache()
    return _result(rows, lengths, timings, tokenizer=tokenizer)


def _run(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    sampler: _Sampler,
    ids: torch.Tensor,
    length_t: torch.Tensor,
    *,
    step: Callable[..., torch.Tensor],
    slots: int,
    speculate: SpecConfig | None,
    prefix_cache: PrefixCache | None,
) -> _Timings:
    """Prefill (after the prefix cache's part), then decode every row to its end, plainly or
    speculatively; the prompts go into the prefix cache while their K/V are still in place."""
    rows, device = sampler.rows, sampler.device
    spec_stats: SpecStats | None = None
    latencies: list[float] = []
    timer = Timer(device).start()
    start = _load_prefixes(model, prompts, prefix_cache)
    tokens = sampler.pick(prefill(model, ids, lengths=length_t, start=start))
    sampler.handle(tokens)
    ttft = timer.lap()
    cache_slots = torch.arange(slots, device=device)
    positions = length_t.clone()  # the slot each row's next fed token goes to
    if speculate is not None:
        if rows[0].finish_reason is None:
            spec_stats = SpecStats()
            latencies = _speculative_decode(
                model, list(prompts[0]), rows[0], tokens[0], sampler.params, speculate,
                chain=sampler.chain, generator=sampler.generator, timer=timer,
                on_token=sampler.on_token, stats=spec_stats,
            )  # fmt: skip
    else:
        latencies = _decode_loop(
            model, sampler, tokens, positions, cache_slots, step=step, timer=timer
        )
    wall = timer.elapsed()
    if prefix_cache is not None:  # the prompts' positions are still theirs
        for b, prompt in enumerate(prompts):
            _store_prefix(model, prompt, prefix_cache, b)
    return _Timings(ttft, latencies, wall, start, spec_stats)


def _decode_loop(
    model: CausalLM,
    sampler: _Sampler,
    tokens: list[int],
    positions: torch.Tensor,
    cache_slots: torch.Tensor,
    *,
    step: Callable[..., torch.Tensor],
    timer: Timer,
) -> list[float]:
    """Feed each row's newest token (with fast-forward's forced tokens, batch 1) until every
    row is done. positions [B]: the slot each row's next fed token goes to; cache_slots: the
    cache's slot indices [S]. Returns one latency per generated token after the first."""
    rows, device = sampler.rows, sampler.device
    batch, slots = len(rows), cache_slots.shape[0]
    latencies: list[float] = []
    while any(r.finish_reason is None for r in rows):
        forced = sampler.forced_after(tokens[0])
        if forced and rows[0].finish_reason is None:
            # Sampled + forced tokens in one call of k rows, causal among themselves.
            fed = torch.tensor([[tokens[0], *forced]], device=device)
            at = positions[:, None] + torch.arange(fed.shape[1], device=device)
            mask = (cache_slots <= at[..., None]).unsqueeze(1)
            logits = model(fed, positions=at, mask=mask, last_only=True)[:, -1]
            positions = positions + len(forced)
        elif rows[0].finish_reason is not None and batch == 1:
            # Fast-forward reached the token limit or a stop string: no step left to run.
            lap = timer.lap()
            latencies.extend([lap / len(forced)] * len(forced))
            break
        else:
            fed = torch.tensor(tokens, device=device).unsqueeze(1)
            mask = (cache_slots <= positions[:, None]).view(batch, 1, 1, slots)
            logits = step(model, fed, positions.unsqueeze(1), mask)
        # Finished rows stay at their slot: never past the cache, never seen by others.
        done = torch.tensor([r.finish_reason is not None for r in rows], device=device)
        positions = torch.where(done, positions, positions + 1)
        tokens = sampler.pick(logits)
        sampler.handle(tokens)
        if forced:  # one latency per token: the call's time spread over what it fed
            lap = timer.lap()
            latencies.extend([lap / (1 + len(forced))] * (1 + len(forced)))
        else:
            latencies.append(timer.lap())
    return latencies


def _result(
    rows: list[_Row], lengths: list[int], timings: _Timings, *, tokenizer: Any
) -> GenerationResult:
    """The rows' tokens, texts and finish reasons, with the call's stats."""
    batch = len(rows)
    stats = GenerationStats(
        prompt_tokens=sum(lengths),
        generated_tokens=len(timings.latencies) + 1,
        ttft_s=timings.ttft,
        decode_latencies_s=timings.latencies,
        wall_s=timings.wall,
        batch_size=batch,
        prefill_skipped=timings.prefix_start * batch,
        speculation=timings.speculation,
    )
    return GenerationResult(
        tokens=[r.tokens for r in rows],
        texts=[r.stream.text for r in rows] if tokenizer is not None else None,
        finish_reasons=[r.finish_reason or "length" for r in rows],
        stats=stats,
    )


# --------------------------------------------------------------------------- prefix cache


def _kv(model: CausalLM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    caches = [layer.self_attn.cache for layer in model.model.layers]
    return [c.k for c in caches], [c.v for c in caches]


def _load_prefixes(
    model: CausalLM, prompts: Sequence[Sequence[int]], cache: PrefixCache | None
) -> int:
    """Positions every row's prompt has in `cache` (the fewest over the rows, whole blocks),
    copied into each row's cache row; 0 without a cache."""
    if cache is None:
        return 0
    start = min(cache.match(prompt) for prompt in prompts)
    if start:
        k, v = _kv(model)
        for b, prompt in enumerate(prompts):
            cache.load(prompt, start, k, v, b)
    return start


def _store_prefix(model: CausalLM, prompt: Sequence[int], cache: PrefixCache, row: int) -> None:
    k, v = _kv(model)
    cache.store(prompt, k, v, row)


# --------------------------------------------------------------------------- speculation


def _speculative_decode(
    model: CausalLM,
    prompt: list[int],
    row: _Row,
    token: int,
    params: SamplingParams,
    config: SpecConfig,
    *,
    chain: list[LogitsProcessor],
    generator: torch.Generator,
    timer: Timer,
    on_token: Callable[[StreamEvent], None] | None,
    stats: SpecStats,
) -> list[float]:
    """Decode one sequence from its first token by draft-and-verify (`runtime.speculate`);
    return one latency per generated token after the first (a call's time spread over the
    tokens it produced)."""
    seq = [*prompt, token]
    drafter, policy = NgramDrafter(seq, config), DraftPolicy(config)
    position = len(prompt)  # where `token` is fed
    latencies: list[float] = []
    while row.finish_reason is None:
        proposal = drafter.propose(config.k)
        # never draft past the token limit: a call emits up to j + 1 tokens
        j = min(policy.length(len(proposal)), row.limit - len(row.tokens) - 1)
        drafts = proposal[: max(j, 0)]
        fed = [token, *drafts]
        began = time.perf_counter()
        logits = verify_logits(model, fed, position)
        policy.times.add(len(fed), time.perf_counter() - began, verify=True)
        if chain:  # each row sees the tokens before it (stateless processors only)
            width = len(seq) + len(drafts)
            history = torch.full((len(fed), width), -1, dtype=torch.long)
            for i in range(len(fed)):
                history[i, width - len(seq) - i :] = torch.tensor([*seq, *drafts[:i]])
            logits = apply_processors(chain, history.to(logits.device), logits)
        out, n = policy.judge(logits, drafts, proposal, params, generator=generator)
        emitted = 0
        for t in out:
            event = row.add(t)
            emitted += 1
            if on_token is not None:
                on_token(event)
            if row.finish_reason is not None:
                break
        stats.record(len(drafts), n, emitted)
        kept = out[:emitted]
        drafter.extend(kept)
        seq.extend(kept)
        position += n + 1
        token = out[-1]
        lap = timer.lap()
        latencies.extend([lap / emitted] * emitted)
    return latencies
