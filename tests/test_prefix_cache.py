"""PrefixCache on small random K/V: exact round trips, match rules, shared blocks, the byte
budget, LRU eviction leaves first, bad arguments, stats."""

from __future__ import annotations

import random

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.runtime.prefix_cache import PrefixCache

LAYERS, HEADS, MAX_LEN, DIM, BLOCK = 2, 2, 64, 4, 4
BB = 2 * LAYERS * HEADS * BLOCK * DIM * 4  # bytes of one fp32 block, K and V


def _kv(rows: int = 3, *, layers: int = LAYERS, dim: int = DIM, dtype=torch.float32):
    k = [torch.full((rows, HEADS, MAX_LEN, dim), -1.0, dtype=dtype) for _ in range(layers)]
    v = [torch.full((rows, HEADS, MAX_LEN, dim), -2.0, dtype=dtype) for _ in range(layers)]
    return k, v


def _fill(k, v, row: int, tokens: list[int]) -> None:
    """Row `row` at position p gets values that depend only on tokens[:p + 1], as real K/V do."""
    h = 0
    for p, t in enumerate(tokens):
        h = (h * 31 + t + 1) % 10007
        for layer, (kt, vt) in enumerate(zip(k, v, strict=True)):
            base = torch.arange(HEADS * DIM, dtype=torch.float32).view(HEADS, DIM)
            kt[row, :, p] = base + h + 0.5 * layer
            vt[row, :, p] = -base - h - 0.25 * layer


def _stored(cache: PrefixCache, tokens: list[int], row: int = 0, **kw) -> int:
    k, v = _kv()
    _fill(k, v, row, tokens)
    return cache.store(tokens, k, v, row, **kw)


def _check_load(cache: PrefixCache, tokens: list[int], n: int, row: int = 2) -> None:
    """load(tokens, n) into a fresh row gives exactly the values of a fresh prefill."""
    want_k, want_v = _kv()
    _fill(want_k, want_v, 0, tokens)
    k, v = _kv()
    ptrs = [t.data_ptr() for t in (*k, *v)]
    cache.load(tokens, n, k, v, row)
    assert [t.data_ptr() for t in (*k, *v)] == ptrs
    for kt, vt, wk, wv in zip(k, v, want_k, want_v, strict=True):
        assert torch.equal(kt[row, :, :n], wk[0, :, :n])
        assert torch.equal(vt[row, :, :n], wv[0, :, :n])
        assert bool((kt[row, :, n:] == -1.0).all()) and bool((vt[row, :, n:] == -2.0).all())
        assert bool((kt[:row] == -1.0).all()) and bool((kt[row + 1 :] == -1.0).all())


def _leaves_first(cache: PrefixCache) -> None:
    """Every block's parent is held and more recent; child counts agree."""
    order = list(cache._lru.values())
    at = {id(node): i for i, node in enumerate(order)}
    counts = {id(node): 0 for node in order}
    for i, node in enumerate(order):
        if node.parent is not None:
            assert at[id(node.parent)] > i
            counts[id(node.parent)] += 1
    assert all(node.children == counts[id(node)] for node in order)


def test_round_trip_into_another_row() -> None:
    cache = PrefixCache(100 * BB, block=BLOCK)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks
    k, v = _kv()
    _fill(k, v, 0, prompt)
    assert cache.store(prompt, k, v, 0) == 2
    assert cache.blocks == 2 and cache.bytes == 2 * BB == 2 * cache.block_bytes
    k[0][0].zero_()  # the cache holds clones, not views of the row
    n = cache.match(prompt)
    assert n == 8
    _check_load(cache, prompt, n)
    _check_load(cache, prompt + [7, 7], 8, row=0)


def test_match_rules() -> None:
    cache = PrefixCache(100 * BB, block=BLOCK)
    prompt = list(range(16))  # 4 blocks
    assert _stored(cache, prompt) == 4
    assert cache.match(prompt) == 12  # at most len - 1, rounded down to a block
    assert cache.match(prompt + [99]) == 16
    assert cache.match(prompt[:13]) == 12
    assert cache.match(prompt[:12]) == 8
    assert cache.match(prompt[:4]) == 0
    assert cache.match(prompt[:5]) == 4
    assert cache.match([]) == 0
    assert cache.match([50 + t for t in prompt]) == 0
    mid = list(prompt)
    mid[10] = 999  # mid-block 3 (index 2)
    assert cache.match(mid + [1]) == 8
    assert cache.match(torch.tensor(prompt + [1])) == 16
    assert cache.match(tuple(prompt[:9])) == 8


def test_shared_prefix_shares_blocks() -> None:
    cache = PrefixCache(100 * BB, block=BLOCK)
    a = list(range(12))
    b = a[:8] + [50, 51, 52, 53, 54, 55, 56, 57]
    assert _stored(cache, a) == 3
    assert cache.bytes == 3 * BB
    assert _stored(cache, b) == 2
    assert cache.bytes == 5 * BB and cache.stats.stored_blocks == 5
    assert _stored(cache, a) == 0 and _stored(cache, b + [1, 2]) == 0
    assert cache.bytes == 5 * BB
    assert cache.match(a + [0]) == 12 and cache.match(b + [0]) == 16
    _check_load(cache, b, 16)
    _check_load(cache, a, 12)
    # Same block tokens after another parent are another block.
    c = [70, 71, 72, 73] + a[4:8]
    assert _stored(cache, c) == 2
    assert cache.match(c + [0]) == 8


def test_upto_stores_only_that_prefix() -> None:
    cache = PrefixCache(100 * BB, block=BLOCK)
    prompt = list(range(20))
    assert _stored(cache, prompt, upto=11) == 2
    assert cache.match(prompt) == 8
    assert _stored(cache, prompt, upto=3) == 0
    assert _stored(cache, prompt, upto=0) == 0


def test_budget_never_exceeded_and_loads_stay_exact() -> None:
    rng = random.Random(0)
    budget = 7 * BB + 100
    cache = PrefixCache(budget, block=BLOCK)
    prompts: list[list[int]] = []
    for _ in range(150):
        if prompts and rng.random() < 0.6:
            base = rng.choice(prompts)
            prompt = base[: rng.randrange(len(base) + 1)]
        else:
            prompt = []
        prompt = prompt + [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        prompt = prompt[:MAX_LEN]
        prompts.append(prompt)
        n = cache.match(prompt)
        _check_load(cache, prompt, n)
        _stored(cache, prompt)
        assert cache.bytes <= budget
        assert cache.bytes == cache.blocks * BB
        _leaves_first(cache)
    assert cache.stats.evicted_blocks > 0 and cache.stats.hits > 0
    assert cache.blocks == cache.stats.stored_blocks - cache.stats.evicted_blocks


def test_lru_evicts_least_recent_chain_first() -> None:
    cache = PrefixCache(4 * BB, block=BLOCK)
    a, b, c = list(range(8)), list(range(20, 28)), list(range(40, 44))
    _stored(cache, a)
    _stored(cache, b)
    assert cache.blocks == 4
    assert cache.match(a + [0]) == 8  # a is now more recent than b
    assert _stored(cache, c) == 1
    assert cache.stats.evicted_blocks == 1
    assert cache.match(a + [0]) == 8
    assert cache.match(b + [0]) == 4  # b's deepest block went first
    assert cache.match(c + [0]) == 4
    _leaves_first(cache)


def test_descendants_go_before_ancestors() -> None:
    cache = PrefixCache(3 * BB, block=BLOCK)
    a, c = list(range(12)), list(range(40, 48))
    _stored(cache, a)
    assert _stored(cache, c) == 2
    assert cache.stats.evicted_blocks == 2
    assert cache.match(a + [0]) == 4  # a's last two blocks, deepest first
    assert cache.match(c + [0]) == 8
    _check_load(cache, a, 4)
    _leaves_first(cache)


def test_a_prompt_does_not_evict_its_own_prefix() -> None:
    cache = PrefixCache(2 * BB, block=BLOCK)
    a = list(range(8))
    b = a[:4] + list(range(30, 38))
    _stored(cache, a)
    assert _stored(cache, b) == 1  # keeps the shared block, evicts a's second, adds one
    assert cache.match(b + [0]) == 8 and cache.match(a + [0]) == 4
    _check_load(cache, b, 8)


def test_prompt_larger_than_budget_stores_its_prefix() -> None:
    cache = PrefixCache(3 * BB + 10, block=BLOCK)
    _stored(cache, list(range(50, 58)))
    prompt = list(range(24))  # 6 blocks
    assert _stored(cache, prompt) == 3
    assert cache.bytes == 3 * BB and cache.stats.evicted_blocks == 2
    assert cache.match(prompt) == 12
    _check_load(cache, prompt, 12)
    assert _stored(cache, prompt) == 0  # the prefix is touched, nothing more fits


@pytest.mark.parametrize("budget", [0, BB - 1])
def test_budget_too_small_stores_nothing(budget: int) -> None:
    cache = PrefixCache(budget, block=BLOCK)
    prompt = list(range(16))
    assert _stored(cache, prompt) == 0
    assert cache.bytes == 0 and cache.blocks == 0
    assert cache.match(prompt) == 0
    assert cache.stats.lookups == 1 and cache.stats.hits == 0


@pytest.mark.parametrize(
    "budget,block,match",
    [
        (-1, 4, "budget: expected bytes >= 0, got -1"),
        (1.5, 4, "budget: expected bytes >= 0, got 1.5"),
        (100, 0, "block: expected tokens >= 1, got 0"),
        (100, -3, "block: expected tokens >= 1, got -3"),
        (100, True, "block: expected tokens >= 1, got True"),
    ],
)
def test_bad_constructor_args(budget, block, match: str) -> None:
    with pytest.raises(GenerationError, match=match):
        PrefixCache(budget, block=block)


def test_bad_load_args() -> None:
    cache = PrefixCache(100 * BB, block=BLOCK)
    prompt = list(range(12))
    _stored(cache, prompt)
    k, v = _kv()
    with pytest.raises(GenerationError, match="expected n a multiple of 4"):
        cache.load(prompt, 6, k, v, 0)
    with pytest.raises(GenerationError, match="expected n a multiple of 4 in \\[0, 12\\], got 16"):
        cache.load(prompt, 16, k, v, 0)
    with pytest.raises(GenerationError, match="expected 8 cached tokens, got 4 cached"):
        cache.load(prompt[:4] + [9, 9, 9, 9], 8, k, v, 0)
    with pytest.raises(GenerationError, match="expected row in \\[0, 3\\), got 3"):
        cache.load(prompt, 8, k, v, 3)
    with pytest.raises(GenerationError, match="got 3 K and 2 V"):
        cache.load(prompt, 8, k + k[:1], v, 0)
    for bad in (_kv(layers=3), _kv(dim=8), _kv(dtype=torch.float64)):
        with pytest.raises(GenerationError, match="expected the layout"):
            cache.load(prompt, 8, *bad, 0)
    short = [t[:, :, :6] for t in k], [t[:, :, :6] for t in v]
    with pytest.raises(GenerationError, match="expected max_len >= 8 tokens, got 6"):
        cache.load(prompt, 8, *short, 0)
    with pytest.raises(GenerationError, match="expected every K/V"):
        cache.load(prompt, 8, k, [v[0], v[1][:2]], 0)
    with pytest.raises(GenerationError, match="expected K/V \\[rows, kv_heads"):
        cache.load(prompt, 8, [t[0] for t in k], [t[0] for t in v], 0)
    cache.load(prompt, 0, k, v, 0)  # nothing to copy
    assert bool((k[0] == -1.0).all())
    assert cache.stats.hit_tokens == 0


def test_bad_store_args_and_layout() -> None:
    cache = PrefixCache(100 * BB, block=BLOCK)
    prompt = list(range(12))
    k, v = _kv()
    with pytest.raises(GenerationError, match="expected upto in \\[0, 12\\], got 13"):
        cache.store(prompt, k, v, 0, upto=13)
    with pytest.raises(GenerationError, match="expected max_len >= 70 tokens, got 64"):
        cache.store(list(range(70)), k, v, 0)
    _stored(cache, prompt)
    k64, v64 = _kv(dtype=torch.float64)
    with pytest.raises(GenerationError, match="expected the layout"):
        cache.store(prompt, k64, v64, 0)
    cache.clear()
    assert cache.blocks == 0 and cache.bytes == 0 and cache.match(prompt) == 0
    assert cache.store(prompt, k64, v64, 0) == 3  # an empty cache takes a new layout
    assert cache.bytes == 3 * 2 * BB and cache.block_bytes == 2 * BB


def test_stats() -> None:
    cache = PrefixCache(3 * BB, block=BLOCK)
    assert cache.stats.hit_rate() == 0.0
    assert cache.stats.as_dict()["token_hit_rate"] == 0.0
    a, b = list(range(10)), list(range(20, 30))
    assert cache.match(a) == 0
    _stored(cache, a)
    n = cache.match(a)
    _check_load(cache, a, n)
    assert cache.match(b) == 0
    _stored(cache, b)  # evicts one block of a
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens, s.looked_up_tokens) == (3, 1, 8, 30)
    assert (s.stored_blocks, s.evicted_blocks) == (4, 1)
    assert s.hit_rate() == pytest.approx(1 / 3)
    d = s.as_dict()
    assert set(d) == {
        "lookups",
        "hits",
        "hit_tokens",
        "looked_up_tokens",
        "stored_blocks",
        "evicted_blocks",
        "hit_rate",
        "token_hit_rate",
    }
    assert d["token_hit_rate"] == pytest.approx(8 / 30) and d["hit_rate"] == pytest.approx(1 / 3)
    cache.clear()
    assert cache.stats.evicted_blocks == 1 and cache.stats.lookups == 3
