"""How the serving engine runs its forwards: one interface, `RowRunner`, two implementations.

The engine holds one KV cache of every slot (`SlotKV`) and asks for two kinds of forward:

- `run_rows(tokens, positions, slots)`: a decode step, one token per row, row r at cache slot
  slots[r] and position positions[r]; returns the fp32 logits [R, V] of exactly those rows, in
  their order, and how many rows were computed (the step's `DecodeStep.window`);
- `run_chunk(slot, tokens, start)`: a prefill chunk, the tokens at positions start, start + 1,
  ... of one slot, causally; returns the logits [1, V] of its last token.

`PathRows` runs both through the model's one-call decode path (`CausalLM.decode_path`: on a
CPU, every layer of a step in one C call), bound once to the store of every slot: it computes
exactly the rows asked for, and a prefill chunk is the chunk's tokens as rows of one call at one
slot (a chunk longer than the path's `max_rows` takes the PyTorch layers, as in `generate`).

`WindowRows` runs the PyTorch layers through `CausalLM.forward` over a window of the cache: a
decode step covers slots [0, hi), hi = 1 + the highest slot asked for; a slot in that window
that was not asked for is fed what the engine's `idle(slot)` says, a dummy token at a position
where the write is harmless. Every query attends to its own row's positions <= its own, so a
row computes exactly what it would alone. The attention width is cut to the longest position in
the window (rounded up to `WIDTH_ROUND`), not the whole cache.

The engine picks one when it installs its caches (`PathRows` where the model's path binds,
else `WindowRows`) and calls it for every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from quantkit.errors import GenerationError
from quantkit.models.decoder import CausalLM, FastPath, KVCache
from quantkit.models.kv_cache import KVFormat
from quantkit.runtime.head import logits_of_rows

__all__ = ["WIDTH_ROUND", "PathRows", "RowRunner", "SlotKV", "WindowRows", "round_width"]

# The attention window is rounded up to this many positions: fewer distinct shapes, and a
# masked position costs one dot product.
WIDTH_ROUND = 32


def round_width(needed: int, max_len: int) -> int:
    return min(max_len, -(-needed // WIDTH_ROUND) * WIDTH_ROUND)


class SlotKV(KVCache):
    """One layer's K/V for every slot, [slots, Hkv, max_len, D], kept in `store_k`/`store_v`.

    Before each PyTorch forward, `select` points the model's `KVCache.k`/`.v` at a window of it
    (rows [start, stop), positions [0, width)) as views, not copies: the model's own `update`
    then writes into the slots' storage and attends to the window only. The one-call path is
    bound to the whole store (`select_all`).
    """

    def __init__(
        self,
        slots: int,
        max_len: int,
        *,
        kv_heads: int,
        head_dim: int,
        like: torch.Tensor,
        fmt: KVFormat | None = None,
    ) -> None:
        super().__init__(
            slots, max_len, kv_heads, head_dim, dtype=like.dtype, device=like.device, fmt=fmt
        )
        self.store_k, self.store_v = self.k, self.v

    def select(self, start: int, stop: int, width: int) -> None:
        self.k = self.store_k[start:stop, :, :width]
        self.v = self.store_v[start:stop, :, :width]

    def select_all(self) -> None:
        self.k, self.v = self.store_k, self.store_v


class RowRunner(Protocol):
    """The engine's forwards (see the module docstring)."""

    def run_rows(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        *,
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """(fp32 logits [R, V] of exactly these rows in their order, rows computed).
        row_invariant: each row exactly as a one-row call computes it (a `PathRows` only)."""
        ...

    def run_chunk(self, slot: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        """fp32 logits [1, V] of the last of `tokens`, fed at `slot`, positions start, ..."""
        ...


class WindowRows:
    """The PyTorch layers over slots [0, hi) of the cache (see the module docstring).

    idle(slot): the (token, position) a slot that was not asked for feeds to a decode step,
    where its write is harmless."""

    def __init__(
        self,
        model: CausalLM,
        caches: Sequence[SlotKV],
        max_len: int,
        idle: Callable[[int], tuple[int, int]],
    ) -> None:
        self.model, self.caches, self.max_len, self.idle = model, caches, max_len, idle
        self.device = model.device
        self.positions = torch.arange(max_len, device=self.device)

    def select(self, start: int, stop: int, width: int) -> None:
        for cache in self.caches:
            cache.select(start, stop, width)

    def run_rows(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        *,
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, int]:
        if row_invariant or len(set(slots)) != len(slots):
            raise GenerationError(
                "window rows: expected one row per slot and no row_invariant (the PyTorch "
                f"layers), got slots {slots}, row_invariant={row_invariant}"
            )
        hi = 1 + max(slots)
        given = {s: (t, p) for s, t, p in zip(slots, tokens, positions, strict=True)}
        fed = [given.get(slot) or self.idle(slot) for slot in range(hi)]
        fed_positions = [p for _, p in fed]
        width = round_width(max(fed_positions) + 1, self.max_len)
        self.select(0, hi, width)
        pos = torch.tensor(fed_positions, device=self.device).unsqueeze(1)
        ids = torch.tensor([t for t, _ in fed], device=self.device).unsqueeze(1)
        mask = (self.positions[:width] <= pos).view(hi, 1, 1, width)
        logits = self.model(ids, positions=pos, mask=mask)[:, -1]
        if len(slots) != hi or slots != list(range(hi)):
            logits = logits[slots]  # the rows asked for, in their order
        return logits, hi

    def run_chunk(self, slot: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        n = len(tokens)
        end = start + n
        width = round_width(end, self.max_len)
        self.select(slot, slot + 1, width)
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        mask = (self.positions[:width] <= pos[0, :, None]).view(1, 1, n, width)
        at = torch.tensor([n - 1], device=self.device)
        return self.model(ids, positions=pos, mask=mask, logits_at=at)[:, -1]


class PathRows:
    """The model's one-call decode path, bound to the store of every slot: exactly the rows
    asked for, each at its own slot and position (see the module docstring). `longer`: the
    runner of prefill chunks longer than the path's `max_rows`."""

    def __init__(self, model: CausalLM, path: FastPath, longer: RowRunner) -> None:
        self.model, self.path, self.longer = model, path, longer
        self.max_rows = path.max_rows

    def run_rows(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        *,
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, int]:
        hidden = self.path.run_rows(
            self.model, tokens, positions, slots, row_invariant=row_invariant
        )
        return logits_of_rows(self.model, hidden, row_invariant=row_invariant), len(slots)

    def run_mixed(
        self, tokens: list[int], positions: list[int], slots: list[int], logit_rows: list[int]
    ) -> torch.Tensor:
        """One call over decode rows and prefill-chunk rows together (a chunk: rows of one slot
        at consecutive positions, as `run_chunk` feeds them): fp32 logits [len(logit_rows), V]
        of the rows at those indices only (a chunk's last row where its prompt ends)."""
        hidden = self.path.run_rows(self.model, tokens, positions, slots)
        if not logit_rows:  # only chunks that do not end their prompts: nothing to sample
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return logits_of_rows(self.model, hidden[logit_rows], row_invariant=False)

    def run_chunk(self, slot: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        n = len(tokens)
        if n > self.max_rows:
            return self.longer.run_chunk(slot, tokens, start)
        # The chunk's tokens as rows of one call, all at this slot (a causal prefill); only the
        # last row's state is wanted (`tail_rows`: the same bits).
        hidden = self.path.run_rows(
            self.model, list(tokens), list(range(start, start + n)), [slot] * n,
            out_rows=1 if self.path.tail_rows else None,
        )  # fmt: skip
        return self.model.logits(hidden[-1:])[:, -1]
