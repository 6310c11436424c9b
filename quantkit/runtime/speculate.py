"""Speculative decoding with prompt-lookup (n-gram) drafting: fewer forward passes, same output.

Drafting. Input-grounded text (repeat, summarize, extract, edit) copies spans of its prompt.
`NgramDrafter` indexes every n-gram (n = `max_n` down to `min_n`) of a sequence's tokens so far
(prompt + output) by where it last ended; at each step it looks up the sequence's last n tokens
(the longest n that was seen before) and proposes the up to k tokens that followed that earlier
occurrence. No second model, O(1) a step.

Verification. The last sampled token and the j drafted ones are fed as j + 1 rows of one call
(the decoder's multi-row step, causal among themselves); row i's logits give the distribution
of the token after draft i. On a CPU the C step runs these rows `row_invariant`: each row is
bit-identical to the one-row call plain decoding would make, so greedy speculation reproduces
plain greedy decoding token for token, by construction. Acceptance (`accept`):
- greedy: drafts are accepted while each equals its row's argmax; the first mismatch is replaced
  by the argmax, and when all j match, row j's argmax is a bonus token;
- sampling: the standard rejection rule for a draft that proposes one token with probability 1
  (Leviathan et al. 2023; Chen et al. 2023): accept draft d with probability p(d); on rejection,
  sample from p with d removed, renormalized; after j acceptances sample the bonus from row j.
  Each emitted token is then distributed exactly as `sample` would draw it from the same logits.
The KV cache needs no undo: the rows of rejected drafts sit past the sequence's new end, and the
next call writes those positions before any query can read them.

When to draft (`DraftPolicy`). A verification of j + 1 rows costs more than a one-row step, so
drafts pay only where they are accepted. The policy keeps an estimate of the chance that a draft
token is accepted given the ones before it were (an EMA over every verified draft token, and a
free "shadow" check of the first draft token on steps that did not draft), and the measured time
of a call of each row count; it drafts the j (0..k) that maximises the expected tokens per
second, E(j) / t(j + 1) with E(j) = 1 + a + ... + a^j. On free-form text the acceptance falls and
drafting switches itself off; the shadow checks switch it back on when the text starts copying.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantkit.errors import GenerationError
from quantkit.models.decoder import CausalLM
from quantkit.runtime.head import logits_of_rows
from quantkit.runtime.sampling import (
    SamplingParams,
    greedy_list,
    greedy_tokens,
    logits_to_probs,
)

__all__ = [
    "DraftPolicy",
    "NgramDrafter",
    "SpecConfig",
    "SpecStats",
    "accept",
    "parse_speculate",
    "plan_drafts",
    "verify_logits",
]

DEFAULT_K = 4
# Acceptance estimate before anything was verified, and how fast it follows new evidence.
PRIOR_ACCEPT = 0.5
EMA = 0.15


@dataclass(frozen=True)
class SpecConfig:
    """`--speculate ngram[:k]`: draft up to k tokens by prompt lookup, n-grams of min_n..max_n
    tokens. adaptive: let `DraftPolicy` pick the draft length (0 = off) each step; else draft
    k whenever a match is found."""

    k: int = DEFAULT_K
    min_n: int = 2
    max_n: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 15:
            raise GenerationError(f"speculate: expected 1 to 15 draft tokens, got {self.k}")
        if not 1 <= self.min_n <= self.max_n:
            raise GenerationError(
                f"speculate: expected 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}"
            )

    def describe(self) -> str:
        return f"ngram:{self.k}" + ("" if self.adaptive else " (fixed)")


_SPEC = re.compile(r"ngram(?::(\d+))?")


def parse_speculate(text: str | None) -> SpecConfig | None:
    """'ngram' or 'ngram:K' -> SpecConfig; 'off', '' or None -> None."""
    if text is None or text.strip().lower() in ("", "off", "none"):
        return None
    match = _SPEC.fullmatch(text.strip().lower())
    if match is None:
        raise GenerationError(f"speculate: expected 'ngram', 'ngram:K' or 'off', got {text!r}")
    return SpecConfig(k=int(match.group(1))) if match.group(1) else SpecConfig()


class NgramDrafter:
    """Prompt-lookup drafts over one sequence's tokens (see the module docstring)."""

    def __init__(self, tokens: Sequence[int], config: SpecConfig) -> None:
        self.config = config
        self.tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence that has a successor
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing the n-grams each one completes."""
        lo, hi = self.config.min_n, self.config.max_n
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # the n-grams ending before the new token now have a successor
            for n in range(lo, hi + 1):
                if end >= n:
                    self._last[tuple(seq[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix n-gram
        (max_n down to min_n) seen before; [] when none was. Where that continuation runs
        into the end of the sequence, the sequence is read as repeating with that period (a
        run "a b a b" continues "a b ..."), so a loop drafts k tokens, not one."""
        seq = self.tokens
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if len(seq) <= n:
                continue
            at = self._last.get(tuple(seq[-n:]))
            if at is not None:
                out: list[int] = []
                for i in range(at, at + k):
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                return out
        return []


@dataclass
class SpecStats:
    """What speculation did over a run: verification calls, tokens drafted and accepted."""

    verify_steps: int = 0  # calls that verified >= 1 draft token
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    plain_steps: int = 0  # one-row steps (nothing drafted)
    emitted: int = 0  # tokens produced by all steps (accepted + one per step)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per verification call."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        steps = self.verify_steps + self.plain_steps
        return self.emitted / steps if steps else 0.0

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.emitted += emitted
        if drafted:
            self.verify_steps += 1
            self.drafted += drafted
            self.accepted += accepted
        else:
            self.plain_steps += 1

    def as_dict(self) -> dict[str, float | int]:
        return {
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted, 3),
            "tokens_per_step": round(self.tokens_per_step, 3),
        }


class DraftPolicy:
    """One sequence's acceptance estimate (see the module docstring) and, through
    `plan_drafts`, how many draft tokens it verifies next. The call-time table may be shared
    by the sequences of one engine (`times`)."""

    def __init__(self, config: SpecConfig, times: CallTimes | None = None) -> None:
        self.config = config
        self.accept_rate = PRIOR_ACCEPT
        self.times = times or CallTimes()

    def length(self, available: int) -> int:
        """Draft tokens to verify now, 0..available (<= k), for a sequence decoded alone."""
        return plan_drafts([self], [available], self.times)[0]

    def judge(
        self,
        logits: torch.Tensor,
        drafts: Sequence[int],
        proposal: Sequence[int],
        params: SamplingParams,
        *,
        generator: torch.Generator,
    ) -> tuple[list[int], int]:
        """`accept` the verified `drafts` (of `proposal`, what the drafter offered) and learn
        from the outcome: each verified draft token, or, when none was verified, a free check
        of the proposal's first token against the one decoded. With no drafts `accept` draws
        exactly what `sample` would, from the same generator."""
        out, n = accept(logits, drafts, params, generator=generator)
        if drafts:
            self.observe(len(drafts), n)
        elif proposal:
            self.observe(1, int(out[0] == proposal[0]))
        return out, n

    def observe(self, verified: int, accepted: int) -> None:
        """`verified` draft tokens were checked (0 with a shadow check: pass 1 and whether
        the first draft token was right), `accepted` of them in a row were right."""
        for i in range(verified):
            hit = 1.0 if i < accepted else 0.0
            self.accept_rate += EMA * (hit - self.accept_rate)
            if not hit:
                break


def plan_drafts(
    policies: Sequence[DraftPolicy], available: Sequence[int], times: CallTimes
) -> list[int]:
    """Draft lengths for the sequences of one step (one row each without drafts) that
    maximise expected tokens per second. Draft tokens are added one at a time, each time the
    one with the best chance of being accepted (a^(j+1) for a sequence at draft length j), and
    the best prefix of those additions is kept: a longer plan must beat a shorter one by 2%.
    Non-adaptive policies draft every available token (up to k)."""
    n = len(policies)
    caps = [min(a, p.config.k) for p, a in zip(policies, available, strict=True)]
    if not any(p.config.adaptive for p in policies):
        return caps
    js, order = [0] * n, []
    best, best_rate, expected = 0, n / times.estimate(n, verify=False), float(n)
    while True:
        pick = max(
            (p.accept_rate ** (js[i] + 1), i)
            for i, p in enumerate(policies)
            if js[i] < caps[i]
        ) if any(js[i] < caps[i] for i in range(n)) else None  # fmt: skip
        if pick is None:
            break
        gain, i = pick
        js[i] += 1
        order.append(i)
        expected += gain
        rate = expected / times.estimate(n + len(order), verify=True)
        if rate > best_rate * 1.02:
            best, best_rate = len(order), rate
    plan = [0] * n
    for i in order[:best]:
        plan[i] += 1
    return plan


class CallTimes:
    """Measured seconds of a decoder call of r rows (an EMA per r), for plain steps and for
    verification calls (row-invariant: slower per row) apart; at one row they are the same
    call. An unmeasured count is estimated from the largest measured smaller one plus, per
    extra row, a share of a one-row call: 0.2 for plain steps, 0.3 for verification (on a
    2-core AVX512-BF16 Xeon, SmolLM2 INT4: plain 8 rows 2.1x one row; row-invariant 2 rows
    1.2x, 3 rows 1.4x, 4 rows 1.9x, 8 rows 3.0x). Measured counts replace the guesses."""

    _SHARE = {False: 0.2, True: 0.3}

    def __init__(self) -> None:
        self._ema: dict[tuple[bool, int], float] = {}

    def add(self, rows: int, seconds: float, *, verify: bool) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        key = (verify and rows > 1, rows)
        old = self._ema.get(key)
        self._ema[key] = seconds if old is None else old + 0.2 * (seconds - old)

    def estimate(self, rows: int, *, verify: bool) -> float:
        kind = verify and rows > 1
        if (kind, rows) in self._ema:
            return self._ema[(kind, rows)]
        share = self._SHARE[kind]
        one = self._ema.get((False, 1))
        known = sorted(r for k, r in self._ema if k == kind)
        if one is None:
            if not known:
                return 1.0 + (rows - 1) * share
            one = self._ema[(kind, known[0])] / (1.0 + (known[0] - 1) * share)
        below = [r for r in known if r < rows]
        if below:
            r0 = below[-1]
            return self._ema[(kind, r0)] + (rows - r0) * one * share
        return one * (1.0 + (rows - 1) * share)


def accept(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    *,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) from the verification logits [j + 1, V] of the j
    drafts (row i: the distribution after draft i; row 0: after the last sampled token). The
    tokens are the accepted drafts then one more (a correction or the bonus), 1..j + 1 of them.
    Processors (penalties, masks) must already be applied to each row."""
    j = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != j + 1:
        raise GenerationError(
            f"accept: expected logits [{j + 1}, V] for {j} drafts, got {tuple(logits.shape)}"
        )
    if params.greedy:
        best = greedy_list(logits)
        n = 0
        while n < j and drafts[n] == best[n]:
            n += 1
        return [*drafts[:n], best[n]], n
    probs = logits_to_probs(logits, params)
    out: list[int] = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        if u.item() < probs[i, d].item():
            out.append(int(d))
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        out.append(_draw(residual, generator))
        return out, i
    out.append(_draw(probs[j], generator))
    return out, j


def _draw(p: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised probabilities p [V] (the exponential race of `sample`)."""
    race = torch.empty_like(p).exponential_(1.0, generator=generator)
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return int(greedy_tokens((p / race).unsqueeze(0))[0])


def verify_logits(model: CausalLM, tokens: Sequence[int], start: int) -> torch.Tensor:
    """fp32 logits [R, V] of tokens fed at cache row 0, positions start, start + 1, ...,
    causally: row i is the distribution after tokens[i]. On the bound C step the rows run
    `row_invariant` (each bit-identical to a one-row step); else the PyTorch layers."""
    n = len(tokens)
    path = model.decode_path
    if path is not None and path.is_current():
        positions = list(range(start, start + n))
        hidden = path.run_rows(model, list(tokens), positions, [0] * n, row_invariant=True)
        return logits_of_rows(model, hidden, row_invariant=True)
    device = model.device
    slots = model.model.layers[0].self_attn.cache.k.shape[2]
    ids = torch.tensor([list(tokens)], device=device)
    pos = torch.arange(start, start + n, device=device).unsqueeze(0)
    mask = (torch.arange(slots, device=device) <= pos[0, :, None]).view(1, 1, n, slots)
    return model(ids, positions=pos, mask=mask)[0]
