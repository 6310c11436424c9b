"""Sampling: a chain of pure functions from logits to the next token, after gpt-fast.

One decode step turns the last position's logits [B, V] into B token ids:

    logits processors (penalties, grammar mask, ...)             need the tokens so far
    -> temperature -> top-k -> top-p -> min-p                     need only the logits
    -> sample                                                     needs the torch.Generator

Every filter returns logits of the same shape with the removed entries set to -inf, so filters
compose and a -inf written by a grammar mask survives every later step. Every filter keeps at
least one token per row, provided the row came in with at least one finite logit: a processor
that masks a whole row (a grammar with no allowed token) is a bug in that processor, and this
module does not check for it, since the check would force a device sync on every token.

All functions are vectorized over the batch and the vocabulary (no Python loops over either),
never modify their input in place, and sample only through an explicit `torch.Generator`, so the
same seed gives the same stream and nothing touches torch's global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from quantkit.errors import GenerationError
from quantkit.runtime.kept_argmax import forget, kept_argmax

__all__ = [
    "LogitsProcessor",
    "PresenceFrequencyPenalty",
    "RepetitionPenalty",
    "SamplingParams",
    "apply_min_p",
    "apply_processors",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "default_processors",
    "greedy_list",
    "greedy_tokens",
    "logits_to_probs",
    "make_generator",
    "sample",
]


@runtime_checkable
class LogitsProcessor(Protocol):
    """A hook that rewrites the next-token logits given the tokens so far.

    input_ids: int64 [B, T], every token of each row so far (prompt + generated). Rows of
        different lengths are right-aligned or left-aligned by the caller as it likes, with the
        positions that hold no token filled with a negative id (-1); processors ignore them.
    logits: [B, V] for the next position.
    Returns new logits [B, V] (the grammar layer sets disallowed tokens to -inf). A processor
    may keep per-row state (a grammar guide), so the caller calls it exactly once per step.
    One that never writes its input in place says so with `keeps_logits = True`: the arg-max
    the head kept for those logits stays usable (`kept_argmax`; see `apply_processors`).
    """

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RepetitionPenalty:
    """CTRL's repetition penalty, as transformers applies it.

    For every token already present in the row (prompt included), a positive logit is divided by
    `penalty` and a negative one multiplied by it, so penalty > 1 always makes the token less
    likely. Counted once per token however often it occurred (that would be a frequency penalty).
    """

    penalty: float
    keeps_logits = True  # a new tensor each call, the input untouched

    def __post_init__(self) -> None:
        if not (self.penalty > 0 and math.isfinite(self.penalty)):
            raise GenerationError(
                f"repetition_penalty: expected a finite number > 0, got {self.penalty}"
            )

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.penalty == 1.0:
            return logits
        valid = input_ids >= 0
        # scatter_add (not scatter) because a token may occur many times in a row; scatter with
        # duplicate indices writes in an unspecified order.
        counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
        counts.scatter_add_(1, input_ids.clamp_min(0), valid.to(torch.int32))
        penalized = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
        return torch.where(counts > 0, penalized, logits)


class PresenceFrequencyPenalty:
    """OpenAI's presence and frequency penalties, over the tokens generated so far.

    logit[t] -= presence * (count[t] > 0) + frequency * count[t], where count[t] is how often
    token t was generated (the prompt does not count, as in OpenAI's and vLLM's definition).
    Positive values make repeats less likely, negative ones more; each in [-2, 2], 0 = off.

    The generated tokens are every valid id in `input_ids` minus the prompt's, which this
    processor is built with, so it works whichever way the caller aligns the rows; every row
    must hold that same prompt (one request: the server builds one per request).
    """

    keeps_logits = True  # a new tensor each call, the input untouched

    def __init__(self, presence: float, frequency: float, prompt: Sequence[int]) -> None:
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise GenerationError(f"{name}: expected a number in [-2, 2], got {value}")
        self.presence, self.frequency = float(presence), float(frequency)
        self.prompt = torch.tensor([int(t) for t in prompt], dtype=torch.int64)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.presence == 0.0 and self.frequency == 0.0:
            return logits
        valid = input_ids >= 0
        counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
        counts.scatter_add_(1, input_ids.clamp_min(0), valid.to(torch.int32))
        if self.prompt.numel():
            prompt = self.prompt.to(logits.device).expand(logits.shape[0], -1)
            counts.scatter_add_(1, prompt, torch.full_like(prompt, -1, dtype=torch.int32))
        counts = counts.clamp_min(0).to(logits.dtype)
        return logits - self.presence * (counts > 0).to(logits.dtype) - self.frequency * counts


def _is_count(value: object, *, minimum: int) -> bool:
    # bool is an int subclass; True as a token count is a caller's mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature: 0 = greedy (argmax, no randomness); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 or None = off.
    top_p: keep the smallest set of most likely tokens whose mass is >= top_p; 1.0 = off.
    min_p: keep tokens whose probability is >= min_p * the top token's; 0 = off.
    repetition_penalty: CTRL penalty on tokens already present (see `RepetitionPenalty`); 1 = off.
    seed: seeds the `torch.Generator`; None = a fresh random seed.
    max_new_tokens: the most tokens generated per sequence (>= 1).
    stop: strings that end generation when they appear in the generated text.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # `not (x >= 0)` rather than `x < 0` so that NaN is rejected too.
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise GenerationError(f"temperature: expected a number >= 0, got {self.temperature}")
        if self.top_k is not None and not _is_count(self.top_k, minimum=0):
            raise GenerationError(
                f"top_k: expected an integer >= 0 (0 or None = off), got {self.top_k}"
            )
        if not (0 < self.top_p <= 1):
            raise GenerationError(f"top_p: expected a number in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            raise GenerationError(f"min_p: expected a number in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise GenerationError(
                f"repetition_penalty: expected a number > 0 (1 = off), "
                f"got {self.repetition_penalty}"
            )
        if not _is_count(self.max_new_tokens, minimum=1):
            raise GenerationError(
                f"max_new_tokens: expected an integer >= 1, got {self.max_new_tokens}"
            )
        if isinstance(self.stop, str):
            # A bare string would silently become one stop string per character.
            raise GenerationError(
                f"stop: expected a tuple of strings, got the string {self.stop!r}"
            )
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise GenerationError(f"stop: expected non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def default_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors `params` asks for by itself (today: the repetition penalty, if on)."""
    if params.repetition_penalty != 1.0:
        return [RepetitionPenalty(params.repetition_penalty)]
    return []


def apply_processors(
    processors: list[LogitsProcessor], input_ids: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Run `processors` in order, each on the previous one's output. A processor that does
    not say it leaves its input alone (`keeps_logits`) may write it in place: the arg-max the
    head kept for those logits is dropped first (`kept_argmax.forget`)."""
    for processor in processors:
        if not getattr(processor, "keeps_logits", False):
            forget(logits)
        logits = processor(input_ids, logits)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by the temperature (> 0; temperature 0 means greedy and never reaches here)."""
    if not temperature > 0:
        raise GenerationError(
            f"apply_temperature: expected temperature > 0 (0 = greedy is handled by sample), "
            f"got {temperature}"
        )
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """Keep the `top_k` largest logits per row; 0/None (or k >= V) keeps all.

    Ties at the k-th value are all kept (as in gpt-fast), so a row may keep more than k tokens.
    """
    if not top_k or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass is >= top_p.

    A token is dropped when the mass of the tokens strictly more likely than it already reaches
    top_p; the most likely token always has zero mass before it, so it is always kept.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # float32 for the cumulative sum: in bf16 it drifts by ~1e-2 over a 50k vocabulary.
    sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is >= min_p x the most likely token's; 0 = off.

    p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p), so no softmax is needed, and
    the top token (logit_i == logit_max) is always kept.
    """
    if min_p <= 0.0:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    return logits.masked_fill(logits < threshold, -math.inf)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: float32 [B, V], rows summing to 1.

    Greedy (temperature 0) is the one-hot of the argmax; otherwise the chain temperature ->
    top-k -> top-p -> min-p, then softmax. Filtered tokens get probability exactly 0.
    """
    if params.greedy:
        index = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
            -1, index, 1.0
        )
    # float32 from here: bf16 logits / a temperature round to ties that change the argmax.
    logits = apply_temperature(logits.float(), params.temperature)
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    logits = apply_min_p(logits, params.min_p)
    return torch.softmax(logits, dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, *, generator: torch.Generator
) -> torch.Tensor:
    """Pick one token per row: int64 [B].

    Temperature 0 is exactly `logits.argmax(-1)` and draws nothing from the generator. Otherwise
    the exponential race: argmax(p_i / E_i) with E_i ~ Exponential(1) i.i.d. selects token i
    with probability p_i (E_i / p_i is Exponential(p_i); the smallest of independent exponentials
    is i with probability p_i / sum p). Unlike torch.multinomial it needs no device sync and draws
    exactly B x V numbers per step, so the stream for a seed does not depend on the probabilities.
    The generator must live on the logits' device.
    """
    _check_rows(logits)
    if params.greedy:
        return greedy_tokens(logits)
    probs = logits_to_probs(logits, params)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # exponential_ may return exactly 0 in float32; a 0 would turn a masked token's 0/0 into
    # NaN, which argmax treats as the maximum. Clamping keeps 0-probability tokens at 0.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return greedy_tokens(probs / race)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (the first of tied maxima; a NaN counts as the maximum). On the CPU
    the arg-max the head's kernel kept while writing these logits (`kept_argmax`), else
    through NumPy, whose argmax gives the same index: torch's took 85 us for one 49k-vocabulary
    row against 4 us, a percent of a SmolLM2 INT4 decode step."""
    kept = kept_argmax(logits)  # kept for a CPU float32 head's logits only
    if kept is not None:
        return torch.tensor(kept, dtype=torch.int64)
    return _argmax(logits)


def greedy_list(logits: torch.Tensor) -> list[int]:
    """`greedy_tokens(logits).tolist()`; the arg-max the head kept is given as it is, without a
    tensor made and read back (each torch call 7-12 us cold inside `generate`)."""
    kept = kept_argmax(logits)  # the head's [M, V] logits or a view of all of them
    if kept is not None:
        return list(kept)
    _check_rows(logits)
    return _argmax(logits).tolist()


def _check_rows(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise GenerationError(f"sample: expected logits [B, V], got shape {tuple(logits.shape)}")


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, through NumPy for CPU float32 logits (the same index)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device`, seeded with `params.seed` (a fresh random seed when None)."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator
