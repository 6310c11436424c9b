"""The grammar as a `LogitsProcessor`: one matcher per row (either engine), a bitmask per step.

Each row is an `OutlinesRow` (an outlines-core Guide) or an `LlgRow` (an llguidance matcher,
wrapped in a `llguidance.distinct_items.DistinctRow` where uniqueItems is checked on the text),
from its CompiledGrammar's `new_row`; a batch may mix them, since both fill the same int32
bitmask layout. Each call (one per decode step, as `quantkit.runtime.sampling.LogitsProcessor`
requires):

1. advance every live row by the token the previous step sampled for it (the last column of
   input_ids); a row whose token was an EOS, or -1 (the caller already finished it), is done
   and is never advanced again: EOS is not text;
2. let each row write its allowed-token bitmask straight into one int32 buffer [B, V/32]
   (native code, no Python loop over the vocabulary); rows in an accepting state also get every
   EOS id, so a sequence can only end where the grammar is complete;
3. with a token budget, rows close to running out are steered to finish in time (`budget`);
4. set the disallowed logits to -inf: one C pass over the bits and the logits on CPU, numpy or
   torch elsewhere; single-threaded, no OpenMP threads competing with the model's (see
   `_apply_mask`). On CPU (float32) the result goes into one buffer the processor keeps, so the
   tensor a call returns is overwritten by the next call: use it before calling again;
5. JSON rows whose model's best allowed token would corner a key (`llguidance.key_corners`) are
   screened on the masked logits: each such token is cleared in the bits and set to -inf.

Greedy (`greedy=True`: the caller takes the arg-max of what a call returns): steps 2-5 are
skipped where each row can tell, token by token, which token its mask would leave as the best
(`verdict.Verdict`: llguidance tries the token; no repeated key or item, runaway rule or key
corner in play). The row is asked about its best tokens in turn until one is allowed (a
refused one is left out of the mask for certain), or, under budget steering, about the tokens
along its path (the int8 and int6 heads keep each row's 8 best tokens, `kept_best`, so the
row is not read for them). Where the best is allowed the logits go back as they came; else,
for one row, the processor's buffer with the pick alone finite (the row is not copied: a cold
49k-float row copied twice cost ~40 us a refusing step in `generate`), for more rows a copy
with the refused tokens ahead of each pick at -inf. Either way their arg-max is the token the
mask would have left, so the output is the same. In generated JSON the model's best token is
usually allowed (18 of 24 steps on the demo schema, and 3 more take a later one), and the mask
is what a step cost most.

The time of every call is kept in `mask_times_s` (see `mask_stats`), with the time fast-forward
spent advancing the rows since the call before (`forced_tokens`): the grammar's whole cost per
step.

Fast-forward (`forced_tokens`): after a token is sampled, the decode loop may ask which tokens
the grammar forces next (llguidance rows only), append them without sampling and feed them all
in one model call; the row is advanced by them at once, and the next call then expects input_ids
to have grown by those columns too.

The processor holds per-generation state: create one per `generate()` call, or `reset()` it.
It checks that input_ids grows by one column per call (plus any fast-forwarded ones), which
catches reuse without a reset.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from quantkit.errors import GrammarError
from quantkit.fused_kernels.cpu.logit_mask import mask_logits, mask_logits_available
from quantkit.grammar.budget import WINDOW, CompletionPlan
from quantkit.grammar.compiler import CompiledGrammar
from quantkit.grammar.verdict import Verdict
from quantkit.grammar.vocabulary import byte_tokens
from quantkit.runtime.kept_argmax import forget, keep_rows, kept_best

__all__ = ["GrammarLogitsProcessor"]

# Inside the budget window, walk at most this many allowed tokens through the plan (Python,
# ~1 us a byte); a state allowing more is free text, where single bytes are tried instead.
_WALK_LIMIT = 4096
# An llguidance row's walk to completion stops this many bytes past what could still fit.
_PATH_SLACK = 64
# A complete llguidance row ends (EOS only) once no more than this many tokens are spare.
_FINISH_GUARD = 48
# Greedy: the best tokens a row is asked about before the mask decides (`_probe`); on
# JSONSchemaBench 9 in 10 of the steps whose best token the grammar refuses allow one of the
# next 8.
_PROBES = 8
# Tokens until an llguidance row whose walk found no completion walks again: an eighth of
# those left, at least this many.
_RETRY = 4


def _bit(token: int) -> np.int32:
    """The int32 word with only `token`'s bit (token % 32) set."""
    return np.uint32(1 << (token & 31)).view(np.int32)


def _apply_mask(
    logits: torch.Tensor, bits: np.ndarray, out: torch.Tensor | None = None
) -> torch.Tensor:
    """logits with the tokens whose bit is clear set to -inf (a new tensor, or `out` on the C
    path).

    On CPU with float32 logits one C pass (`fused_kernels.cpu.logit_mask`) reads the bits and
    the logits once and writes the result: after the decode step has streamed the weights
    through every cache, the numpy path below (unpack the bits, a fresh -inf row, copy where
    allowed) took 150-400 us a 49k row on a 2-core EPYC, the C pass ~10. Elsewhere (float64,
    no C compiler) numpy, single-threaded: torch's masked_fill splits a 49k-wide row over its
    OpenMP threads, which on a busy 2-core machine took 1.7 ms per call instead of 31 us on one
    thread (measured), the oversubscription the issue warns about. On other devices torch.
    """
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and _c_mask():
        return mask_logits(logits, bits, out=out)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little")
    allowed = allowed.view(np.bool_)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        array = logits.numpy()
        out = np.full(array.shape, -np.inf, dtype=array.dtype)
        np.copyto(out, array, where=allowed)
        return torch.from_numpy(out)
    allowed_t = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
    return logits.masked_fill(allowed_t.logical_not(), float("-inf"))


def _host_float(t: torch.Tensor) -> bool:
    """Whether `t` reads as a numpy view (CPU float32 or float64): writes to it are writes to
    `t`."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


@functools.cache
def _c_mask() -> bool:
    """Whether the C mask pass loads here (checked once per process)."""
    return mask_logits_available()


class GrammarLogitsProcessor:
    """Constrain each row of a batch to its grammar.

    grammars: one CompiledGrammar for every row, or a sequence with one per row (None leaves
        that row unconstrained). All must share one vocabulary.
    max_new_tokens: the generation's token budget; given, a row whose remaining tokens come
        within `budget.WINDOW` of what completing its document needs is steered to finish in
        time (single-byte tokens that keep completion within the budget; see `budget`). The
        rows this happened to are in `steered`.
    greedy: the caller takes the arg-max of what each call returns (temperature 0). Then a
        step where every row tells which token the mask would leave as its best (`_greedy`)
        returns logits with that arg-max without masking: the tokens are the same, and the
        step skips the mask, its pass over the logits and the key screen. Counted in
        `unmasked`.
    """

    # Writes only buffers of its own (`_buffer`), never the logits it is given.
    keeps_logits = True

    def __init__(
        self,
        grammars: CompiledGrammar | Sequence[CompiledGrammar | None],
        *,
        max_new_tokens: int | None = None,
        greedy: bool = False,
    ) -> None:
        self.greedy = greedy
        self._per_row = not isinstance(grammars, CompiledGrammar)
        given = list(grammars) if self._per_row else [grammars]  # type: ignore[arg-type]
        present = [g for g in given if g is not None]
        if not present:
            raise GrammarError(
                "grammar processor: expected at least one compiled grammar, got none"
            )
        prints = {g.vocabulary.fingerprint for g in present}
        if len(prints) > 1:
            raise GrammarError(
                f"grammar processor: expected grammars compiled for one vocabulary, got "
                f"{len(prints)}"
            )
        self._grammars = given
        self.vocabulary = present[0].vocabulary
        self._eos = sorted(self.vocabulary.eos_token_ids)
        self.max_new_tokens = max_new_tokens
        # byte -> a token that is exactly that byte (every byte-level vocabulary has them).
        self._byte_token = byte_tokens(self.vocabulary)
        _c_mask()  # load the C mask pass now (~10 ms once), not inside the first step's time
        self.mask_times_s: list[float] = []
        self.reset()

    def reset(self) -> None:
        """Forget all rows: the next call starts a new generation."""
        self._guides: list[Any] = []
        self._ahead: set[int] = set()  # rows already advanced past input_ids' last column
        self._extra = 0  # fast-forwarded columns input_ids gains before the next call
        self.forced_count = 0  # tokens fed without sampling (fast-forward), this generation
        self.unmasked = 0  # greedy steps whose best tokens needed no mask, this generation
        self.refused = 0  # tokens a greedy step refused ahead of its pick, this generation
        self._done: list[bool] = []
        self._counts: list[int] = []
        self.steered: set[int] = set()
        self._width: int | None = None
        self._bits: np.ndarray | None = None
        self._out: torch.Tensor | None = None  # the masked logits, reused step to step
        self._out_np = np.empty((0, 0), dtype=np.float32)  # its numpy view (`_buffer`)
        self._hot: int | None = None  # the token a one-hot row in it keeps (`_one_hot`)
        self._kept_hot = False  # `kept_argmax` holds that token as the buffer's arg-max
        self._between_s = 0.0  # time in `forced_tokens` since the last call
        self._walked: dict[int, tuple[str, bytes]] = {}  # steering planned by `_greedy`
        self._host: bool | None = None  # whether the logits read as numpy views (`_greedy`)
        self._f32: bool | None = None  # whether they are CPU float32 (`_buffer`)
        self._shape: tuple[int, int] = (0, 0)  # this call's logits' shape

    @property
    def token_count(self) -> int:
        """Tokens the rows have advanced by so far (sampled and fast-forwarded, EOS excluded)."""
        return sum(self._counts)

    @property
    def finished(self) -> list[bool]:
        """Per row: whether its grammar is complete (an accepting state) right now."""
        return [g is None or g.is_finished() for g in self._guides]

    def _start(self, batch: int, vocab: int) -> None:
        if vocab < self.vocabulary.size:
            raise GrammarError(
                f"grammar processor: expected logits at least as wide as the vocabulary "
                f"({self.vocabulary.size}), got {vocab}"
            )
        if self._per_row and len(self._grammars) != batch:
            raise GrammarError(
                f"grammar processor: expected {len(self._grammars)} rows (one per grammar), "
                f"got {batch}"
            )
        grammars = self._grammars if self._per_row else self._grammars * batch
        self._guides = [None if g is None else g.new_row() for g in grammars]
        self._plans = [None if g is None else g.plan for g in grammars]
        self._done = [False] * batch
        self._counts = [0] * batch
        # llguidance rows: walk to completion again once the tokens left fall to this.
        self._check_at = [float("inf")] * batch
        # Padded embeddings: bits past the tokenizer's size stay 0, never allowed.
        self._bits = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)

    def _advance(self, last: list[int]) -> None:
        eos = set(self._eos)
        for row, (guide, token) in enumerate(zip(self._guides, last, strict=True)):
            if self._done[row] or guide is None or row in self._ahead:
                continue
            if token < 0 or token in eos:
                self._done[row] = True
                continue
            if guide.advance(token):
                self._counts[row] += 1
            else:
                raise GrammarError(
                    f"row {row}: token {token} is not allowed by the grammar (a masked token was "
                    f"sampled: the processor must run last-but-sampling, once per step)"
                )

    def forced_tokens(self, row: int, token: int, *, limit: int) -> list[int]:
        """Advance `row` by `token` (just sampled, not yet seen by this processor) and by the
        tokens its grammar then forces (at most `limit`), and return those: the caller appends
        them without sampling and adds them to input_ids before the next call. Its time counts
        in the next call's `mask_times_s` (the advance is part of a step's grammar cost)."""
        started = time.perf_counter()
        try:
            return self._forced(row, token, limit=limit)
        finally:
            self._between_s += time.perf_counter() - started

    def _forced(self, row: int, token: int, *, limit: int) -> list[int]:
        guide = self._guides[row]
        if guide is None or self._done[row] or row in self._ahead or token in self._eos:
            return []
        if not guide.advance(token):
            raise GrammarError(f"row {row}: token {token} is not allowed by the grammar")
        self._counts[row] += 1
        self._ahead.add(row)
        forced = guide.forced_tokens()[: max(limit, 0)]
        for t in forced:
            if not guide.advance(t):  # internal invariant: the engine forced it
                raise AssertionError(f"row {row}: forced token {t} was refused")
        self._counts[row] += len(forced)
        self._extra = max(self._extra, len(forced))
        self.forced_count += len(forced)
        return forced

    def _fill(self, logits: torch.Tensor) -> np.ndarray:
        bits = self._bits
        assert bits is not None  # set by _start
        for row, guide in enumerate(self._guides):
            line = bits[row]
            if guide is None or self._done[row]:
                line.fill(-1)  # unconstrained / finished rows: leave their logits alone
                continue
            line.fill(0)
            guide.fill(line)
            plan = self._plans[row]
            if self.max_new_tokens is not None and plan is not None:
                self._steer(row, line, guide, plan)
            elif self.max_new_tokens is not None and hasattr(guide, "closing_path"):
                self._steer_walk(row, line, guide)
            if guide.is_finished():
                for token in self._eos:
                    line[token >> 5] |= _bit(token)
            elif not line.any():
                why = (": every token the grammar allows would repeat an earlier item of a "
                       "uniqueItems array" if getattr(guide, "cleared", 0) else "")  # fmt: skip
                raise GrammarError(f"row {row}: the grammar allows no token here (a dead end){why}")
        return bits

    def _steer(self, row: int, line: np.ndarray, guide: Any, plan: CompletionPlan) -> None:
        """Inside the budget window, keep the tokens after which the document can still be
        completed (and closed with EOS) in the tokens left; when none can, the ones that get
        closest to completion. Bytes bound tokens from above, so this is conservative."""
        assert self.max_new_tokens is not None
        left = self.max_new_tokens - self._counts[row]  # tokens left, this step's included
        state = guide.guide.get_state()  # plans exist for outlines-core rows only
        need = plan.dist.get(state)
        if need is None or left > need + 1 + WINDOW:
            return
        self.steered.add(row)
        if left <= 1 and guide.is_finished():  # the last token: only EOS (the caller adds it)
            line.fill(0)
            return
        bits = np.unpackbits(line.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocabulary.size])
        if len(allowed) > _WALK_LIMIT:  # free text: try the single-byte tokens only
            singles = [self._byte_token.get(b) for b in plan.step.get(state, {})]
            allowed = np.asarray([t for t in singles if t is not None and bits[t]], dtype=np.int64)
        scored = []
        for token in allowed.tolist():
            data = self.vocabulary.token_bytes.get(token)
            after = plan.after(state, data) if data is not None else None
            if after is not None:
                scored.append((after, token))
        if not scored:
            return
        # After this token, left - 1 tokens remain and one of them must be the EOS.
        fits = [t for d, t in scored if d <= left - 2]
        best = min(d for d, _ in scored)
        keep = np.zeros_like(line)
        for token in fits or [t for d, t in scored if d == best]:
            keep[token >> 5] |= _bit(token)
        line[:] = keep

    def _steer_walk(self, row: int, line: np.ndarray, guide: Any) -> None:
        """The llguidance rows' budget steering (`llguidance.closing`): walk a copy of the
        row's matcher to completion when the tokens left come near the last walk's length
        (halfway there from the last walk, then every step inside the window), and inside
        the window allow only the tokens that follow the walk's path (EOS alone once the
        document is complete). Left alone when no such token is allowed (a distinct-items
        check took it out)."""
        kind, path = self._walked.pop(row, None) or self._walk_plan(row, guide)
        if kind == "none":
            return
        self.steered.add(row)
        if kind == "end":  # only EOS (added by the caller)
            line.fill(0)
            return
        keep = np.zeros_like(line)
        for token in guide.along(path):
            word, bit = token >> 5, _bit(token)
            if line[word] & bit:
                keep[word] |= bit
        if keep.any():
            line[:] = keep

    def _walk_plan(self, row: int, guide: Any) -> tuple[str, bytes]:
        """What budget steering does to `row` this step, walking when a walk is due: ("none",
        b"") nothing, ("end", b"") only EOS, ("path", path) the tokens along `path`."""
        assert self.max_new_tokens is not None
        left = self.max_new_tokens - self._counts[row]  # tokens left, this step's included
        if left - (1 + WINDOW) <= _FINISH_GUARD and guide.is_finished():
            # Complete, and near the end: what could follow (another tool call, another
            # statement) would have to be closed again in the tokens left; end it here. Checked
            # every step: a row is complete for a step at a time, between walks.
            return "end", b""
        if left > self._check_at[row]:
            return "none", b""
        limit = left + WINDOW + _PATH_SLACK
        path, complete = guide.closing_path(limit=limit)
        if not complete and len(path) < limit:  # no way found (a loop): try again later
            self._check_at[row] = left - max(_RETRY, left // 8)
            return "none", b""
        # Complete, or longer than what could fit (then followed as far as it goes: the
        # closest to completion the tokens left can come).
        spare = left - (len(path) + 1 + WINDOW)  # the EOS takes one of the tokens left
        if spare > 0:
            self._check_at[row] = left - max(1, spare // 2)
            return "none", b""
        return ("path", path) if path else ("end", b"")

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        shape, ids_shape = logits.shape, input_ids.shape  # read once: torch calls cost, cold
        if len(shape) != 2 or len(ids_shape) != 2 or ids_shape[0] != shape[0]:
            raise GrammarError(
                f"grammar processor: expected input_ids [B, T] and logits [B, V], got "
                f"{tuple(ids_shape)} and {tuple(shape)}"
            )
        batch, vocab = shape
        self._shape = (batch, vocab)
        width = ids_shape[1]
        if self._width is None:
            self._start(batch, vocab)
        else:
            want = self._width + 1 + self._extra
            if width != want or batch != len(self._guides):
                raise GrammarError(
                    f"grammar processor: expected input_ids with {want} columns (one more than "
                    f"last step, plus fast-forwarded ones), got {width}; use a new processor or "
                    f"reset() per generate call"
                )
            if len(self._ahead) < len(self._guides):  # else fast-forward advanced every row
                self._advance(input_ids[:, -1].tolist())
            self._ahead.clear()
            self._extra = 0
        self._width = width
        if self.greedy:
            picked = self._greedy(logits)
            if picked is not None:
                self.unmasked += 1
                self._timed(started)
                return picked
        bits = self._fill(logits)
        out = _apply_mask(logits, bits, self._buffer(logits))
        self._screen(out, bits)
        self._timed(started)
        return out

    def _timed(self, started: float) -> None:
        """Keep this call's time, with the advances `forced_tokens` made since the last."""
        self.mask_times_s.append(time.perf_counter() - started + self._between_s)
        self._between_s = 0.0

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Greedy: logits whose arg-max in every row is the token the mask would leave as the
        best, found without the mask, or None (then the mask decides). Each constrained row
        is asked about its best tokens in turn (`_probe`), or, where budget steering is in
        play, about the tokens along its path (`_along`). Where every row's best token is
        allowed, `logits` as they came; else, for one row, everything but its pick at -inf
        (`_one_hot`), and for more a copy with, per row, the tokens refused ahead of the pick
        at -inf (a steered row: everything but the pick). Not for outlines rows (their budget
        plans)."""
        plans: dict[int, tuple[str, bytes]] = {}
        picked = self._pick(logits, plans)
        # A due walk is made once: where the mask decides, its steering follows these plans.
        self._walked = {} if picked is not None else plans
        return picked

    def _pick(self, logits: torch.Tensor, plans: dict[int, tuple[str, bytes]]
              ) -> torch.Tensor | None:  # fmt: skip
        # The rows' best tokens as the head kept them (`kept_best`): where a row's best is
        # allowed, or a later one of them, the logits are barely read here (a numpy view of
        # them cost 9 us cold inside generate, a copy of a row ~25 us more).
        kept = None if self._host is False else kept_best(logits)
        view: list[np.ndarray] = []  # the logits as numpy, made when first needed

        def rows() -> np.ndarray:
            if not view:
                # One kind of logits a generation: told once (torch's device checks cost).
                if self._host is None:
                    self._host = _host_float(logits)
                view.append(logits.detach().numpy() if self._host else
                            logits.float().cpu().numpy())  # fmt: skip
            return view[0]

        refused: dict[int, list[int]] = {}
        only: dict[int, int] = {}
        value = 0.0  # the one row's pick's score, where it picked past refused tokens
        for row, guide in enumerate(self._guides):
            if guide is None or self._done[row]:
                continue
            if self._plans[row] is not None or not hasattr(guide, "verdict"):
                return None
            plan = ("none", b"")
            if self.max_new_tokens is not None:  # llguidance rows: `_steer_walk`'s plan
                plan = plans[row] = self._walk_plan(row, guide)
            if plan[0] != "none":
                self.steered.add(row)
            if plan[0] == "end":  # only an EOS (`_steer_walk`), where it is complete
                if not guide.is_finished():
                    return None
                scores = rows()[row]
                token = max(self._eos, key=lambda t: (scores[t], -t))
                if not math.isfinite(scores.item(token)):
                    return None
                only[row] = token
                continue
            if plan[0] == "path":
                token = self._along(guide, plan[1], rows()[row])
                if token is None:
                    return None
                only[row] = token
                continue
            found = self._probe(guide, lambda r=row: rows()[r], None if kept is None else kept[row])
            if found is None:
                return None
            if found[0]:
                refused[row] = found[0]
                only[row], value = found[1]
                self.refused += len(found[0])
        if not only:
            return logits
        hot = len(self._guides) == 1  # one row: steered to one token, or past refused ones
        out = self._buffer(logits, whole=not hot)
        if out is None:
            return None  # not CPU float32 logits: the mask decides
        if hot:
            token = only[0]
            return self._one_hot(out, token, value if refused else rows()[0].item(token))
        target = self._out_np
        np.copyto(target, rows())
        for row, tokens in refused.items():
            target[row, tokens] = -np.inf
        for row, token in only.items():
            if row in refused:
                continue
            score = target[row, token]
            target[row].fill(-np.inf)
            target[row, token] = score
        return out

    def _probe(self, guide: Any, scores: Callable[[], np.ndarray], best: list[int] | None
               ) -> tuple[list[int], tuple[int, float]] | None:  # fmt: skip
        """The tokens refused ahead of the row's best allowed token (the sampler's arg-max
        order: higher score first, then the lower id), asking about at most `_PROBES`; None
        where one is not told (`Verdict.UNKNOWN`), an EOS or padding comes first, or none of
        those asked is allowed; with them the pick and its score (0.0 where the head's
        arg-max is allowed: no score is read). scores: the row's logits, asked for only where
        needed; best: the row's best tokens as the head kept them (`kept_best`: arg-max order,
        values finite, -1 after the last), taken in turn before the row is read at all."""
        refused: list[int] = []
        work = None  # the row's scores once read (copied at a refusal: the refused at -inf)
        copied = False
        token = best[0] if best is not None else -1
        if token < 0:
            work = scores()
            token = int(work.argmax())
        for probe in range(1, _PROBES + 1):
            if token >= self.vocabulary.size or (
                work is not None and not math.isfinite(work.item(token))
            ):
                return None  # padding (never allowed), or nothing left with a score
            found = self._verdict(guide, token)
            if found == Verdict.ALLOWED:  # the pick, and its score
                value = 0.0 if not refused else (scores() if work is None else work).item(token)
                return refused, (token, value)
            if found != Verdict.REFUSED:
                return None
            refused.append(token)
            if work is None and best is not None and probe < len(best) and best[probe] >= 0:
                token = best[probe]  # the head's next best
                continue
            if not copied:  # past the kept tokens: read the row (a copy to write in)
                work, copied = (scores() if work is None else work).copy(), True
                work[refused] = -np.inf
            else:
                work[token] = -np.inf
            token = int(work.argmax())
        return None

    def _verdict(self, guide: Any, token: int) -> Verdict:
        """The row's verdict on `token`; an EOS is allowed exactly where the document is
        complete (`_fill` adds it then, after the row's own mask, and the key screen never
        clears it: an EOS writes no key)."""
        if token in self._eos:
            return Verdict.ALLOWED if guide.is_finished() else Verdict.REFUSED
        return guide.verdict(token)

    def _along(self, guide: Any, path: bytes, scores: np.ndarray) -> int | None:
        """A steered row's pick: the best of the tokens along `path` that the row's mask
        keeps (what `_steer_walk` leaves), or None where one is not told, none is allowed (the
        mask is then left whole) or the document is complete (an EOS competes)."""
        if guide.is_finished():
            return None
        for token in sorted(guide.along(path), key=lambda t: (-scores[t], t)):
            if not math.isfinite(scores.item(token)):
                return None
            found = guide.verdict(token)
            if found == Verdict.ALLOWED:
                return token
            if found != Verdict.REFUSED:
                return None
        return None

    def _buffer(self, logits: torch.Tensor, *, whole: bool = True) -> torch.Tensor | None:
        """The reused output of the C mask pass (CPU float32 logits), or None. whole: the
        caller writes all of it (no one-hot row is kept in it after, `_hot`); else only
        `_one_hot` writes it. The kind of logits is told once a generation and the shape read
        once a call (torch's attribute calls cost several us each, cold inside `generate`)."""
        if self._f32 is None:
            self._f32 = logits.device.type == "cpu" and logits.dtype == torch.float32
        if not self._f32:
            return None
        out = self._out
        fresh = out is None or self._out_np.shape != self._shape
        if fresh:
            out = self._out = torch.empty(self._shape, dtype=torch.float32)
            self._out_np = out.numpy()  # made once: a numpy view cost 9 us cold a step
        if whole or fresh:
            self._hot = None
        if self._kept_hot:  # the pick `_one_hot` kept for it is about to be written over
            self._kept_hot = False
            forget(out)
        return out

    def _one_hot(self, out: torch.Tensor, token: int, value: float) -> torch.Tensor:
        """`out` (the one-row buffer) as -inf but `value` at `token`: a steered row's pick,
        or one picked past refused tokens.
        Where the buffer holds such a row already (`_hot`, the token it keeps) only that token
        and this one are written, not the row's 49k floats twice (a copy of the logits, then
        -inf over it: ~20 us a step inside `generate`, a steered row pays it every step)."""
        row = self._out_np[0]
        if self._hot is None:
            row.fill(-np.inf)
        else:
            row[self._hot] = -np.inf
        row[token] = value
        self._hot = token
        if math.isfinite(value):  # the row's arg-max is the pick: the sampler reads no row
            keep_rows(out, [[token]])
            self._kept_hot = True  # until the buffer is written again (`_buffer`)
        return out

    def _screen(self, out: torch.Tensor, bits: np.ndarray) -> None:
        """Keys that could only end as a repeat: each JSON row's screen on its masked logits
        (`llguidance.key_corners`), after the mask, so that its arg-maxes see allowed tokens
        only; what it clears is -inf in `out` too."""
        own = out is self._out  # the C pass's buffer: its numpy view is made already
        view = own or _host_float(out)
        for row, guide in enumerate(self._guides):
            if guide is None or self._done[row] or not hasattr(guide, "screen"):
                continue
            if own:
                scores = self._out_np[row]
            else:
                scores = out[row].numpy() if view else out[row].float().cpu().numpy()
            cleared = guide.screen(bits[row], scores)
            if cleared and not view:
                out[row, cleared] = float("-inf")

    def mask_stats(self) -> dict[str, float]:
        """Mean and p99 of the per-step mask time, in microseconds, over `calls` steps."""
        times = np.asarray(self.mask_times_s) * 1e6
        if times.size == 0:
            return {"calls": 0, "mean_us": float("nan"), "p99_us": float("nan")}
        return {
            "calls": int(times.size),
            "mean_us": float(times.mean()),
            "p99_us": float(np.percentile(times, 99)),
        }
