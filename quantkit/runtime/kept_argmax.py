"""Each row's arg-max of a step's logits, and its next best tokens, kept by the head's C kernel as
it stored them.

A greedy step needs one index of the logits row: the arg-max. Read back after the head, the row
is cold: the head streamed its weights (28 MB for SmolLM2's int8 head) through every cache after
writing the first logits, and one numpy arg-max over 49152 of them took 25-32 us inside
`generate` against 2.2 us on the same row hot (2-core Zen 5), a tenth of the grammar's whole
per-token cost. The int8 and int6 head GEMVs (`qk_i8i8_gemv`, `qk_i6i8_gemv`) keep each row's
largest value and its column while they store the tiles, at no measurable cost, and the head
keeps the result with the logits tensor it returns (`keep`: one slot, the last call's).
`kept_argmax` hands it back only for those very logits, unchanged: the tensor the head returned
or a view of all of it (the decode
loop's `[:, -1]`), not written since: outside inference mode its version counter must be
where the head left it; inference tensors keep none, so whatever may write logits in place
drops the kept value first (`forget`: `sampling.apply_processors` before any processor not
marked `keeps_logits`; a head under a final soft-cap, which `CausalLM.logits` applies in
place, keeps none). Anything else (a copy, a masked tensor, another head) gets None and the
caller takes the arg-max itself. The kept index is numpy's: the first of
equal maxima; a row with a NaN is not kept (numpy's arg-max takes the NaN).

The kernels keep each row's `QK_TOP` (8) best tokens in that order (larger first, the lower
column among equal values), as far as their values are finite: `kept_best`. A grammar's greedy
step whose best token is refused asks about the next ones in that order; without them it read
the cold row twice (a copy, then an arg-max per refusal: ~50-100 us such a step).

A grammar's step that returns one finite logit (a pick past refused tokens, a steered token)
keeps it the same way (`keep_rows`, on its own output buffer): the sampler then takes that
arg-max without reading the row back. The grammar forgets it before it writes the buffer again.
"""

from __future__ import annotations

import torch

__all__ = ["forget", "held", "keep", "keep_rows", "kept_argmax", "kept_best"]

# The last head call's: (logits, their address, shape and strides, each row's arg-max, version,
# each row's best tokens as the kernel wrote them: -1 after the last kept),
# one slot replaced by every call, its Python values read once here (in the head's step, not
# in the grammar's). Holding the logits keeps their memory from being reused, so a tensor over
# the same address, shape and strides is these logits or a view of all of them (inference
# mode tracks no view bases). The cost: the last call's logits live until the next call, at
# most 16 rows (the GEMVs' limit: 9.7 MB at a 151936-token vocabulary).
_kept: (
    tuple[torch.Tensor, int, torch.Size, tuple[int, ...], list[int], int | None, list[list[int]]]
    | None
) = None


def keep(logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Keep `best` (int64 [M, QK_TOP]: each row's best tokens in arg-max order, -1 after the
    last kept; a row all -1 where not kept) for `logits` [M, V], the tensor the head kernel
    wrote; `logits` itself."""
    if not torch.compiler.is_compiling():
        keep_rows(logits, best.tolist())
    return logits


def keep_rows(logits: torch.Tensor, rows: list[list[int]]) -> None:
    """`keep` with each row's best tokens as lists (arg-max order, as long as known, -1 after
    the last): a grammar's one-hot row keeps its pick so that the sampler need not read the
    row back (`GrammarLogitsProcessor._one_hot`)."""
    global _kept
    found = [row[0] if row else -1 for row in rows]
    if not found or min(found) < 0:
        _kept = None
        return
    # Inference tensors keep no version counter: there `forget` is the only guard.
    version = None if logits.is_inference() else logits._version
    _kept = (logits, logits.data_ptr(), logits.shape, logits.stride(), found, version, rows)


def _same(logits: torch.Tensor, kept: tuple) -> bool:  # type: ignore[type-arg]
    return (
        logits.data_ptr() == kept[1]
        and logits.shape == kept[2]
        and logits.stride() == kept[3]
        and (kept[5] is None or logits._version == kept[5])
    )


def forget(logits: torch.Tensor) -> None:
    """Drop the arg-max kept for `logits`, if any: something may write them in place next
    (`sampling.apply_processors` before a processor not known to leave its input alone)."""
    global _kept
    kept = _kept
    if kept is not None and _same(logits, kept):
        _kept = None


def kept_argmax(logits: torch.Tensor) -> list[int] | None:
    """Each row's arg-max of `logits` [B, V] as the head kept it (its value finite), or None
    where it kept none for exactly these values (not the last head call's tensor or a view of
    all of it, written since, or a row it could not tell)."""
    kept = _kept
    if kept is None or not _same(logits, kept):
        return None
    return kept[4]


_NOW = object()


def held() -> object:
    """What is kept now, for `kept_best(..., at=...)` after something else may keep."""
    return _kept


def kept_best(logits: torch.Tensor, at: object = _NOW) -> list[list[int]] | None:
    """Each row's best tokens of `logits` as the head kept them, in arg-max order (`QK_TOP` a
    row, -1 after the last kept; the first is `kept_argmax`'s), or None where `kept_argmax`
    would give none. at: what `held` gave earlier, instead of what is kept now."""
    kept = _kept if at is _NOW else at
    if kept is None or not _same(logits, kept):
        return None
    return kept[6]
