"""Automatic prefix caching: the K/V of prompt prefixes seen before, reused by later prompts.

Many prompts start alike (a system prompt, a few-shot preamble, a conversation so far). Their
K/V at those positions depend only on the tokens up to there, so a new prompt that starts with
a cached prefix can copy those values into its cache row and prefill only the rest.

Blocks. A prompt is cut into fixed-size blocks of `block` tokens (vLLM-style); only full blocks
are cached. Block i is identified by its whole prefix: its key is (the id of block i - 1's
node, the tuple of block i's token ids), block 0's parent id being 0. The dict compares keys by
value, so a hash collision costs a comparison, never a wrong hit; a lookup is O(blocks), each
step hashing one block's tokens. Each block holds one K and one V tensor,
[layers, kv_heads, block, head_dim], clones on the device and in the dtype of the cache they
came from: 2 * layers * kv_heads * block * head_dim * element_size bytes.

Eviction. The blocks held never take more than `budget_bytes`. A block is useless without its
parent, so only leaves (blocks with no cached child) are evicted, the least recently used
first. Every use of a chain (a `match` that hits, `load`, `store`) touches it from its deepest
block back to its first, so every block is more recent than all its descendants: the least
recently used block is always a leaf, and a chain is evicted from its end back. A `store` that
does not fit even after evicting everything else stores what fits, prefix first, and stops.

The layout (layers, kv_heads, head_dim, dtype) is fixed by the first `store` and kept while any
block is held; a cache row of another layout is a `GenerationError`.

Copies in and out of the cache row are in place (`tensor[row, :, a:b].copy_(...)`): other code
holds raw pointers to the cache tensors, so they are never replaced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from quantkit.errors import GenerationError

__all__ = ["PrefixCache", "PrefixCacheStats"]

# (parent block's node id, this block's token ids): the identity of a block's whole prefix.
_Key = tuple[int, tuple[int, ...]]
# (layers, kv_heads, head_dim, dtype) of the blocks held.
_Layout = tuple[int, int, int, torch.dtype]


@dataclass
class PrefixCacheStats:
    """Counters of a `PrefixCache` since it was made (`clear` keeps them)."""

    lookups: int = 0  # match() calls
    hits: int = 0  # match() calls that found >= 1 block
    hit_tokens: int = 0  # tokens served from the cache (sum of what load() copied)
    looked_up_tokens: int = 0  # sum of len(tokens) over match() calls
    stored_blocks: int = 0  # blocks inserted
    evicted_blocks: int = 0  # blocks evicted to stay within the budget (not those clear() drops)

    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = asdict(self)
        out["hit_rate"] = self.hit_rate()
        out["token_hit_rate"] = self.token_hit_rate()
        return out


class _Node:
    """One cached block: its key, its parent, its K/V and how many cached children it has."""

    __slots__ = ("children", "id", "k", "key", "parent", "v")

    def __init__(
        self, node_id: int, key: _Key, parent: _Node | None, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.id, self.key, self.parent, self.k, self.v = node_id, key, parent, k, v
        self.children = 0


class PrefixCache:
    """K/V blocks of prompt prefixes under a byte budget (see the module docstring)."""

    def __init__(self, budget_bytes: int, *, block: int = 32) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise GenerationError(f"prefix cache budget: expected bytes >= 0, got {budget_bytes!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise GenerationError(f"prefix cache block: expected tokens >= 1, got {block!r}")
        self.budget_bytes = budget_bytes
        self.block = block
        self.stats = PrefixCacheStats()
        # Every block, least recently used first; the first one is always a leaf.
        self._lru: OrderedDict[_Key, _Node] = OrderedDict()
        self._layout: _Layout | None = None
        self._block_bytes = 0
        self._next_id = 1  # 0 is the parent id of every first block

    @property
    def bytes(self) -> int:
        """Bytes held now: the K and V tensors of every block."""
        return len(self._lru) * self._block_bytes

    @property
    def blocks(self) -> int:
        return len(self._lru)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V) of the current layout; 0 before the first store."""
        return self._block_bytes

    def clear(self) -> None:
        """Drop every block (not counted as evictions); the stats are kept."""
        self._lru.clear()
        self._layout = None
        self._block_bytes = 0

    # -- lookups

    def _chain(self, tokens: Sequence[int], blocks: int) -> list[_Node]:
        """The cached nodes of the first `blocks` blocks of `tokens`, up to the first miss."""
        ids = tokens if isinstance(tokens, list | tuple) else [int(t) for t in tokens]
        b = self.block
        chain: list[_Node] = []
        parent_id = 0
        for i in range(blocks):
            node = self._lru.get((parent_id, tuple(ids[i * b : (i + 1) * b])))
            if node is None:
                break
            chain.append(node)
            parent_id = node.id
        return chain

    def _touch(self, chain: Sequence[_Node]) -> None:
        """Make a chain most recently used, its first block the most recent of all."""
        for node in reversed(chain):
            self._lru.move_to_end(node.key)

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` are cached: a multiple of `block`, at most
        len(tokens) - 1 (the caller must still run one token for the next-token logits)."""
        self.stats.lookups += 1
        self.stats.looked_up_tokens += len(tokens)
        if not self._lru:
            return 0
        chain = self._chain(tokens, max(len(tokens) - 1, 0) // self.block)
        if chain:
            self.stats.hits += 1
            self._touch(chain)
        return len(chain) * self.block

    # -- copies

    def load(
        self,
        tokens: Sequence[int],
        n: int,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        row: int,
    ) -> None:
        """Copy the cached K/V of tokens[:n] into cache row `row`, positions [0, n), of every
        layer, in place; `n` comes from `match`. The blocks become the most recently used."""
        b = self.block
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % b or n > len(tokens):
            raise GenerationError(
                f"prefix cache load: expected n a multiple of {b} in [0, {len(tokens)}], got {n!r}"
            )
        if n == 0:
            return
        chain = self._chain(tokens, n // b)
        if len(chain) * b != n:
            raise GenerationError(
                f"prefix cache load: expected {n} cached tokens, got {len(chain) * b} cached"
            )
        got = self._check_row(k, v, row, n, "load")
        if got != self._layout:
            raise GenerationError(
                f"prefix cache load: expected the layout (layers, kv_heads, head_dim, dtype) "
                f"{self._layout} of the blocks held, got {got}"
            )
        with torch.no_grad():
            for layer, (kt, vt) in enumerate(zip(k, v, strict=True)):
                kt[row, :, :n].copy_(torch.cat([node.k[layer] for node in chain], dim=1))
                vt[row, :, :n].copy_(torch.cat([node.v[layer] for node in chain], dim=1))
        self._touch(chain)
        self.stats.hit_tokens += n

    def store(
        self,
        tokens: Sequence[int],
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        row: int,
        *,
        upto: int | None = None,
    ) -> int:
        """Cache the full blocks of tokens[:upto] (default all), whose K/V sit in cache row
        `row` at positions [0, upto), as clones. Blocks already cached are only touched. Evicts
        least recently used leaves to make room; stores what fits, prefix first. Returns the
        number of new blocks stored."""
        if upto is None:
            upto = len(tokens)
        if isinstance(upto, bool) or not isinstance(upto, int) or not 0 <= upto <= len(tokens):
            raise GenerationError(
                f"prefix cache store: expected upto in [0, {len(tokens)}], got {upto!r}"
            )
        layout = self._check_row(k, v, row, upto, "store")
        if self._layout is not None and layout != self._layout:
            if self._lru:
                raise GenerationError(
                    f"prefix cache store: expected the layout (layers, kv_heads, head_dim, "
                    f"dtype) {self._layout} of the blocks held, got {layout}"
                )
            self._layout = None
        layers, kv_heads, head_dim, dtype = layout
        block_bytes = 2 * layers * kv_heads * self.block * head_dim * dtype.itemsize
        total = upto // self.block
        if total == 0 or block_bytes > self.budget_bytes:
            return 0
        if self._layout is None:
            self._layout, self._block_bytes = layout, block_bytes
        chain = self._chain(tokens, total)
        self._touch(chain)  # now the chain is the most recent: evicted last
        # Everything but the chain can be evicted, so exactly this many new blocks fit.
        room = (self.budget_bytes - len(chain) * block_bytes) // block_bytes
        new = min(total - len(chain), room)
        if new <= 0:
            return 0
        while self.bytes + new * block_bytes > self.budget_bytes:
            self._evict()
        ids = tokens if isinstance(tokens, list | tuple) else [int(t) for t in tokens]
        b = self.block
        start, stop = len(chain) * b, (len(chain) + new) * b
        with torch.no_grad():
            ks = torch.stack([t[row, :, start:stop] for t in k]).split(b, dim=2)
            vs = torch.stack([t[row, :, start:stop] for t in v]).split(b, dim=2)
        parent = chain[-1] if chain else None
        for i in range(new):
            first = start + i * b
            key = (parent.id if parent else 0, tuple(ids[first : first + b]))
            kb = ks[i].clone(memory_format=torch.contiguous_format)
            vb = vs[i].clone(memory_format=torch.contiguous_format)
            node = _Node(self._next_id, key, parent, kb, vb)
            self._next_id += 1
            if parent is not None:
                parent.children += 1
            self._lru[key] = node
            chain.append(node)
            parent = node
        self._touch(chain)
        self.stats.stored_blocks += new
        return new

    def _evict(self) -> None:
        """Drop the least recently used block, a leaf (see the module docstring)."""
        key, node = self._lru.popitem(last=False)
        if node.children:  # cannot happen while every use touches its whole chain
            self._lru[key] = node
            self._lru.move_to_end(key, last=False)
            raise AssertionError(f"prefix cache: expected a leaf to evict, got {node.children}")
        if node.parent is not None:
            node.parent.children -= 1
        self.stats.evicted_blocks += 1

    def _check_row(
        self,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        row: int,
        n: int,
        what: str,
    ) -> _Layout:
        """The layout of the cache tensors `k`, `v`, checked: [rows, kv_heads, max_len,
        head_dim] each, one shape and dtype in all, row < rows, max_len >= n."""
        if len(k) == 0 or len(k) != len(v):
            raise GenerationError(
                f"prefix cache {what}: expected as many K as V tensors (>= 1), "
                f"got {len(k)} K and {len(v)} V"
            )
        first = k[0]
        if first.dim() != 4:
            raise GenerationError(
                f"prefix cache {what}: expected K/V [rows, kv_heads, max_len, head_dim], "
                f"got shape {tuple(first.shape)}"
            )
        for t in (*k, *v):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise GenerationError(
                    f"prefix cache {what}: expected every K/V {tuple(first.shape)} {first.dtype}, "
                    f"got {tuple(t.shape)} {t.dtype}"
                )
        rows, kv_heads, max_len, head_dim = first.shape
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows:
            raise GenerationError(f"prefix cache {what}: expected row in [0, {rows}), got {row!r}")
        if max_len < n:
            raise GenerationError(
                f"prefix cache {what}: expected max_len >= {n} tokens, got {max_len}"
            )
        return (len(k), kv_heads, head_dim, first.dtype)
