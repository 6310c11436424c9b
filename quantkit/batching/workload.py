"""Synthetic serving workloads: seeded Poisson arrivals, prompt and output lengths drawn from
simple distributions, and optionally a share of long prompts.

A workload is a list of `Request`s, each with its prompt (token ids), its output length and its
arrival time in seconds from the start of the run. Everything comes from one `torch.Generator`
seeded with `WorkloadSpec.seed`, so the same spec gives the same requests on every machine, and a
static and a continuous run (or a run with and without chunked prefill) replay the same load.

- Arrivals: a Poisson process at `rate` requests/s, i.e. exponential gaps of mean 1/rate; the
  first request arrives at t = 0. `rate = inf` puts every request at t = 0 (an offline batch:
  the engine is saturated from the start, which measures its capacity).
- Lengths (`LengthDist.parse`): `N` (fixed), `LO-HI` (uniform integers, both ends included) or
  `lognormal:MEDIAN:SIGMA` (heavy-tailed like real chat prompts; rounded, at least 1).
- Long prompts (`long_prompt_frac`, `long_prompt_len`): exactly round(frac x requests) requests,
  picked at random, get a prompt of `long_prompt_len` tokens. A few long prompts arriving among
  short ones are what chunked prefill is for.
- Shared prefix (`shared_prefix_len`): every prompt starts with the same window of that many
  tokens (a system prompt), then its own `prompt_len` tokens: the load prefix caching is for.
- Prompt tokens: windows of a token stream the caller passes (real text, so the prompts look
  like prose), or uniform random ids when there is none. Decode and prefill time do not depend
  on which ids are fed, so either gives the same timings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.errors import GenerationError

__all__ = ["LengthDist", "Request", "WorkloadSpec", "make_workload", "parse_rate"]

_UNIFORM = re.compile(r"^(\d+)\s*-\s*(\d+)$")


@dataclass(frozen=True)
class LengthDist:
    """Token counts: fixed (a), uniform integers in [a, b], or lognormal (median a, sigma b)."""

    kind: Literal["fixed", "uniform", "lognormal"]
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        ok = {
            "fixed": self.a >= 1 and float(self.a).is_integer(),
            "uniform": 1 <= self.a <= self.b and float(self.a).is_integer(),
            "lognormal": self.a >= 1 and 0 <= self.b <= 4 and math.isfinite(self.b),
        }.get(self.kind, False)
        if not ok:
            raise GenerationError(
                f"length distribution: expected fixed N >= 1, uniform 1 <= LO <= HI or "
                f"lognormal with median >= 1 and sigma in [0, 4], got {self.describe()}"
            )

    @classmethod
    def parse(cls, text: str, *, option: str = "length") -> LengthDist:
        """`N`, `LO-HI` or `lognormal:MEDIAN:SIGMA`; `option` names the flag in the error."""
        spec = text.strip().lower()
        hint = f"{option}: expected N, LO-HI or lognormal:MEDIAN:SIGMA with lengths >= 1"
        try:
            if spec.isdigit():
                return cls("fixed", int(spec))
            if match := _UNIFORM.match(spec):
                return cls("uniform", int(match[1]), int(match[2]))
            if spec.startswith("lognormal:"):
                median, sigma = spec.removeprefix("lognormal:").split(":")
                return cls("lognormal", float(median), float(sigma))
        except (ValueError, GenerationError):
            pass
        raise GenerationError(f"{hint}, got {text!r}")

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        if self.kind == "uniform":
            return f"{self.a:g}-{self.b:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"

    def sample(self, n: int, *, generator: torch.Generator) -> list[int]:
        """n lengths, each >= 1."""
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            low, high = int(self.a), int(self.b)
            return torch.randint(low, high + 1, (n,), generator=generator).tolist()
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        values = torch.exp(math.log(self.a) + self.b * z).round().clamp_min(1)
        return [int(v) for v in values.tolist()]


def parse_rate(text: str, *, option: str = "rate") -> float:
    """Requests per second: a positive number, or `inf` (every request at t = 0)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # also rejects NaN
        raise GenerationError(
            f"{option}: expected a positive number of requests/s or inf, got {text!r}"
        )
    return value


@dataclass(frozen=True)
class Request:
    """One request: prompt token ids, how many tokens to generate, when it arrives (s)."""

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay. rate: requests/s (math.inf = all at once); see the module docstring."""

    requests: int
    rate: float
    prompt_len: LengthDist
    output_len: LengthDist
    long_prompt_frac: float = 0.0
    long_prompt_len: int = 0
    seed: int = 0
    shared_prefix_len: int = 0  # every prompt: these same tokens, then its own prompt_len

    def __post_init__(self) -> None:
        if not (isinstance(self.requests, int) and self.requests >= 1):
            raise GenerationError(f"requests: expected an integer >= 1, got {self.requests!r}")
        if not self.rate > 0:
            raise GenerationError(
                f"rate: expected a positive number of requests/s or inf, got {self.rate}"
            )
        if not 0 <= self.long_prompt_frac <= 1:
            raise GenerationError(
                f"long prompts: expected a fraction in [0, 1], got {self.long_prompt_frac}"
            )
        if not (isinstance(self.shared_prefix_len, int) and self.shared_prefix_len >= 0):
            raise GenerationError(
                f"shared prefix: expected an integer >= 0 tokens, got {self.shared_prefix_len!r}"
            )
        if self.long_prompt_frac > 0 and self.long_prompt_len < 1:
            raise GenerationError(
                f"long prompts: expected a length >= 1, got {self.long_prompt_len}"
            )

    def describe(self) -> str:
        rate = "all at t=0" if math.isinf(self.rate) else f"Poisson {self.rate:g} req/s"
        long = ""
        if self.long_prompt_frac > 0:
            long = f", {self.long_prompt_frac:.0%} long prompts of {self.long_prompt_len}"
        shared = f" after a shared {self.shared_prefix_len}" if self.shared_prefix_len else ""
        return (
            f"{self.requests} requests, {rate}, prompt {self.prompt_len.describe()}{shared}, "
            f"output {self.output_len.describe()}{long}, seed {self.seed}"
        )


def make_workload(
    spec: WorkloadSpec,
    *,
    vocab_size: int,
    max_total: int,
    source_tokens: Sequence[int] | None = None,
) -> list[Request]:
    """The requests of `spec`, sorted by arrival.

    max_total: the most tokens one request may hold (the model's context window). An output
        length is capped at max_total - 1 and a prompt at max_total - output, so every request
        fits; a spec whose every length fits is drawn unchanged.
    source_tokens: a token stream to cut prompts from (cycled when shorter than a prompt);
        None draws uniform ids in [0, vocab_size).
    """
    if max_total < 2:
        raise GenerationError(f"max_total: expected >= 2 tokens, got {max_total}")
    g = torch.Generator().manual_seed(spec.seed)
    n = spec.requests
    if math.isinf(spec.rate):
        arrivals = [0.0] * n
    else:
        gaps = torch.empty(n, dtype=torch.float64).exponential_(spec.rate, generator=g)
        gaps[0] = 0.0
        arrivals = torch.cumsum(gaps, 0).tolist()
    outputs = [min(k, max_total - 1) for k in spec.output_len.sample(n, generator=g)]
    prompts_len = spec.prompt_len.sample(n, generator=g)
    n_long = round(spec.long_prompt_frac * n)
    for i in torch.randperm(n, generator=g)[:n_long].tolist():
        prompts_len[i] = spec.long_prompt_len
    prompts_len = [min(p, max_total - k) for p, k in zip(prompts_len, outputs, strict=True)]
    stream = torch.tensor(list(source_tokens), dtype=torch.int64) if source_tokens else None

    def window(length: int) -> list[int]:
        if stream is None:
            return torch.randint(0, vocab_size, (length,), generator=g).tolist()
        start = int(torch.randint(0, stream.numel(), (1,), generator=g))
        return stream[(start + torch.arange(length)) % stream.numel()].tolist()

    shared = window(spec.shared_prefix_len) if spec.shared_prefix_len else []
    requests = []
    for i in range(n):
        prompt = (shared + window(prompts_len[i]))[: max(1, max_total - outputs[i])]
        requests.append(Request(i, tuple(prompt), outputs[i], arrivals[i]))
    return requests
