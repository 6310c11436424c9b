"""The KV cache formats (`--kv-dtype`): the stored form round-trips within its stated error, and
the C decode step reads and writes the same bytes the PyTorch path does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
from quantkit.models.kv_cache import KV_DTYPE_NAMES, KVCache, kv_format
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.generate import generate
from quantkit.runtime.loader import load_model
from quantkit.runtime.sampling import SamplingParams

needs_c = pytest.mark.skipif(not cpu_kernel_available(), reason="needs gcc for the C kernel")


def _heads(seed: int = 0) -> torch.Tensor:
    """[2, 5, 3, 64]: rows, tokens, heads, head_dim: normal values, a few outliers, one zero
    head and one head of tiny values (fp8's subnormal range once scaled)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 3, 64, generator=g)
    x[0, 1, 2, 7] = 40.0
    x[1, 3, 0] = 0.0
    x[1, 4, 1] *= 1e-30
    return x


def test_int8_round_trip_within_half_a_step() -> None:
    x = _heads()
    fmt = kv_format("int8", torch.float32)
    stored = fmt.pack(x)
    assert stored.dtype == torch.int8 and stored.shape == (2, 5, 3, 68)
    back = fmt.unpack(stored, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[1, 3, 0], torch.zeros(64))
    assert (back - x).abs().max() > 0  # it is lossy: the bound is what holds


def test_fp8_round_trip_within_its_precision() -> None:
    x = _heads(1)
    fmt = kv_format("fp8", torch.float32)
    stored = fmt.pack(x)
    assert stored.dtype == torch.uint8 and stored.shape == (2, 5, 3, 68)
    back = fmt.unpack(stored, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    bound = x.abs() * 2.0**-4 + scale * 2.0**-10  # half an ulp of 3 mantissa bits; subnormals
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back.abs().amax(-1), x.abs().amax(-1))  # each head's absmax is exact


def test_unscaled_formats_and_names() -> None:
    x = _heads(2)
    bf16 = kv_format("bfloat16", torch.float32)
    assert torch.equal(bf16.unpack(bf16.pack(x), torch.float32), x.bfloat16().float())
    assert kv_format("auto", torch.bfloat16).name == "bfloat16"
    assert kv_format(None, torch.float32).storage == torch.float32
    assert set(KV_DTYPE_NAMES) == {"float32", "bfloat16", "int8", "fp8"}
    with pytest.raises(GenerationError, match="expected one of auto, float32.*got 'int4'"):
        kv_format("int4", torch.float32)


def test_cache_writes_packed_and_reads_values() -> None:
    x = _heads(3)  # [B, T, Hkv, D]
    for name in KV_DTYPE_NAMES:
        fmt = kv_format(name, torch.float32)
        cache = KVCache(2, 8, 3, 64, dtype=torch.float32, fmt=fmt)
        positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
        keys, values = cache.update(positions, x, -x)
        assert keys.dtype == torch.float32 and keys.shape == (2, 3, 8, 64)
        want = fmt.unpack(fmt.pack(x), torch.float32)
        torch.testing.assert_close(keys[1, :, 3:8], want[1].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(values[0, :, :5], -want[0].transpose(0, 1), rtol=0, atol=0)
        one = KVCache(1, 8, 3, 64, dtype=torch.float32, fmt=fmt)
        span_k, _ = one.write_span(2, x[:1], x[:1])
        assert span_k.shape == (1, 3, 7, 64)
        torch.testing.assert_close(span_k[0, :, 2:], want[0].transpose(0, 1), rtol=0, atol=0)


@pytest.fixture(scope="module")
def int4_ckpt(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    outcome = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", "auto", False))
    return outcome.save(tmp_path_factory.mktemp("kv") / "int4", source_dir=tiny_llama_dir)


def _prefill_and_step(model, fast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of a 6-token prefill and one decode step on each of 2 rows, and the K caches."""
    path = model.decode_path
    if not fast:
        model.decode_path = None
    s, ids = 32, torch.tensor([[5, 17, 99, 3, 250, 31], [7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        model.setup_cache(batch=2, max_len=s)
        pos = torch.arange(6).expand(2, 6)
        model(ids, positions=pos, mask=(torch.arange(s) <= pos[0, :, None]).view(1, 1, 6, s))
        at = torch.tensor([[6], [6]])
        out = model(
            torch.tensor([[42], [43]]),
            positions=at,
            mask=(torch.arange(s) <= 6).view(1, 1, 1, s).expand(2, 1, 1, s),
        )
    model.decode_path = path
    return out, [layer.self_attn.cache.k.clone() for layer in model.model.layers]


@needs_c
@pytest.mark.parametrize("name", KV_DTYPE_NAMES)
def test_c_step_reads_and_writes_what_pytorch_does(int4_ckpt: Path, name: str) -> None:
    model = load_model(int4_ckpt, tokenizer=False).model
    model.kv_dtype = name
    fast, fast_k = _prefill_and_step(model, True)
    assert model.decode_path.reason == "bound"
    slow, slow_k = _prefill_and_step(model, False)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    fmt = kv_format(name, torch.float32)
    for a, b in zip(fast_k, slow_k, strict=True):  # the decode step's row is the C step's write
        assert a.dtype == fmt.storage
        got = fmt.unpack(a[:, :, 6], torch.float32)
        want = fmt.unpack(b[:, :, 6], torch.float32)
        scale = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= scale * 0.02 + 1e-6).all()


@needs_c
def test_quantized_cache_changes_logits_a_little(int4_ckpt: Path) -> None:
    model = load_model(int4_ckpt, tokenizer=False).model
    ref, _ = _prefill_and_step(model, True)
    for name, most in (("bfloat16", 0.02), ("int8", 0.05), ("fp8", 0.2)):
        model.kv_dtype = name
        out, _ = _prefill_and_step(model, True)
        diff = (out - ref).abs().max().item()
        assert 0 < diff < most * ref.abs().max().item(), (name, diff)


@needs_c
def test_generate_with_int8_cache_on_both_paths(int4_ckpt: Path, monkeypatch) -> None:
    model = load_model(int4_ckpt, tokenizer=False).model
    model.kv_dtype = "int8"
    prompts = [[5, 17, 99, 3, 250, 31], [7, 8]]
    fast = generate(model, prompts, SamplingParams(max_new_tokens=8))
    monkeypatch.setenv("QUANTKIT_CPU_DECODE", "0")
    slow = generate(model, prompts, SamplingParams(max_new_tokens=8))
    assert fast.tokens == slow.tokens


@needs_c
def test_long_rows_split_over_chunks_match_pytorch(int4_ckpt: Path) -> None:
    """A row past 1024 positions has its attention split into 512-position chunks merged at
    the end (flash-decoding); beside it a short row keeps one unit per head. Both rows' logits
    equal the PyTorch layers' over the same (int8) cache."""
    model = load_model(int4_ckpt, tokenizer=False).model
    model.kv_dtype = "int8"
    s, long = 1100, 1030
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 500, (2, long), generator=g)
    out = {}
    for fast in (True, False):
        path = model.decode_path
        if not fast:
            model.decode_path = None
        with torch.no_grad():
            model.setup_cache(batch=2, max_len=s)
            pos = torch.arange(long).expand(2, long)
            mask = (torch.arange(s) <= pos[0, :, None]).view(1, 1, long, s)
            model(ids, positions=pos, mask=mask)  # both rows prefilled to 1030
            at = torch.tensor([[long], [5]])  # row 1 goes back to position 5: a short row
            step_mask = (torch.arange(s) <= at).view(2, 1, 1, s)
            out[fast] = model(torch.tensor([[42], [43]]), positions=at, mask=step_mask)
        model.decode_path = path
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)


@needs_c
@pytest.mark.parametrize("prefix_mb", [0.0, 4.0], ids=["slots", "prefix-cache"])
def test_serving_engine_with_an_int8_cache_gives_each_request_its_tokens(
    int4_ckpt: Path, prefix_mb: float
) -> None:
    """The engine's slot store in int8 (codes and scales in one row), chunked prefill, and the
    prefix cache copying those rows: each request gets the greedy tokens `generate` gives it
    alone with the same cache format."""
    from quantkit.batching.engine import EngineConfig, VirtualClock, run_engine
    from quantkit.batching.workload import Request

    model = load_model(int4_ckpt, tokenizer=False).model
    model.kv_dtype = "int8"
    shared = [5, 17, 99, 3, 250, 31, 7, 8] * 5  # 40 tokens: a whole 32-token prefix block
    prompts = [shared + [11, 12], shared + [13], [21, 22, 23]]
    requests = [Request(i, tuple(p), 6, float(i)) for i, p in enumerate(prompts)]
    alone = [generate(model, [p], SamplingParams(max_new_tokens=6)).tokens[0] for p in prompts]
    config = EngineConfig(batch_cap=2, chunk=8, prefix_cache_mb=prefix_mb)
    result = run_engine(model, requests, config, clock=VirtualClock(step_s=1.0))
    assert [r.tokens for r in result.requests] == alone
    assert model.model.layers[0].self_attn.cache is None
