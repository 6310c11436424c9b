"""The serving engine with fewer forward passes: speculative decoding and the prefix cache give
every request the greedy tokens it gets alone, the cache stays in its budget, and a run says
what it saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.batching.engine import EngineConfig, VirtualClock, run_engine
from quantkit.batching.workload import Request
from quantkit.errors import GenerationError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
from quantkit.models.decoder import CausalLM
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.generate import generate
from quantkit.runtime.loader import load_model
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.sampling import SamplingParams
from quantkit.runtime.speculate import SpecConfig

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not cpu_kernel_available(), reason="needs gcc for the C kernel"),
]

SYSTEM = list(range(40, 40 + 70))  # a shared 70-token system prompt: ends mid-block (32)


@pytest.fixture(scope="module")
def int4(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    outcome = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", "auto", False))
    return outcome.save(tmp_path_factory.mktemp("reuse") / "int4", source_dir=tiny_llama_dir)


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i, (n, k, t) in enumerate([(5, 30, 0.0), (9, 24, 0.0), (3, 40, 2.0), (12, 18, 5.0),
                                   (6, 33, 5.0), (4, 28, 9.0)]):  # fmt: skip
        own = torch.randint(3, 512, (n,), generator=g).tolist()
        prompt = SYSTEM + own if i % 3 else own * 3  # shared prefixes; repeats to draft from
        out.append(Request(i, tuple(prompt), k, t))
    return out


def _model_and_alone(int4: Path, act: str) -> tuple[CausalLM, list[Request], list[list[int]]]:
    """The checkpoint with `act` activations in the GEMVs, the requests, and each request's
    greedy tokens decoded alone (`generate`): the reference every engine run must equal."""
    from quantkit.runtime.fast_path import bf16_activations_available

    if act == "bfloat16" and not bf16_activations_available():
        pytest.skip("needs AVX512-BF16")
    model = load_model(int4, options=RuntimeOptions.cli(act_dtype=act), tokenizer=False).model
    requests = _requests()
    alone = [
        generate(model, [r.prompt], SamplingParams(max_new_tokens=r.max_new_tokens)).tokens[0]
        for r in requests
    ]
    return model, requests, alone


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(batch_cap=3, speculate=SpecConfig()),
        EngineConfig(batch_cap=8, chunk=16, speculate=SpecConfig(k=6, adaptive=False)),
        EngineConfig(batch_cap=1, speculate=SpecConfig(k=3, adaptive=False)),
        EngineConfig(batch_cap=3, prefix_cache_mb=64),
        EngineConfig(
            batch_cap=4, chunk=32, prefix_cache_mb=64, speculate=SpecConfig(adaptive=False)
        ),
    ],
    ids=["spec-3", "spec-8-chunk-fixed", "spec-1", "prefix-3", "both-4-chunk"],
)
def test_greedy_tokens_equal_each_request_alone(int4: Path, act: str, config: EngineConfig):
    model, requests, alone = _model_and_alone(int4, act)
    result = run_engine(model, requests, config, clock=VirtualClock(step_s=1.0))
    assert [r.tokens for r in result.requests] == alone
    if config.speculate is not None:
        spec = result.speculation
        assert spec is not None and "off" not in spec
    if config.speculate is not None and not config.speculate.adaptive:
        # (adaptive drafting follows this machine's measured step times: not asserted)
        assert spec["verify_steps"] > 0 and spec["accepted_tokens"] > 0
        # fewer forward passes than tokens: the point of it
        assert len(result.decode_steps) < sum(len(t) - 1 for t in alone)
    if config.prefix_cache_mb:
        cache = result.prefix_cache
        assert cache is not None and cache["hit_tokens"] >= 64 * 2
        assert cache["bytes"] <= cache["budget_bytes"]
        prefilled = sum(c.tokens for c in result.prefill_chunks)
        assert prefilled == sum(len(r.prompt) for r in requests) - cache["hit_tokens"]


def test_the_cache_keeps_its_budget_and_a_larger_request_completes(int4: Path) -> None:
    model = load_model(int4, tokenizer=False).model
    # tiny model: 2 layers x 2 kv heads x 32 tokens x 32 dims x 4 B x 2 = 32 KiB a block
    config = EngineConfig(batch_cap=2, prefix_cache_mb=40 / 1024)  # 40 KiB: one block
    long = Request(0, tuple(range(3, 3 + 150)), 5, 0.0)  # 4 whole blocks: more than the budget
    again = Request(1, tuple(range(3, 3 + 150)) + (9,), 5, 50.0)
    result = run_engine(model, [long, again], config, clock=VirtualClock(step_s=1.0))
    alone = [
        generate(model, [r.prompt], SamplingParams(max_new_tokens=5)).tokens[0]
        for r in (long, again)
    ]
    assert [r.tokens for r in result.requests] == alone
    cache = result.prefix_cache
    assert cache["bytes"] <= cache["budget_bytes"] and cache["stored_blocks"] == 1
    assert cache["hit_tokens"] == 32  # the block that fitted, reused


def test_speculation_off_says_why(tiny_llama_dir: Path) -> None:
    dense = load_model(tiny_llama_dir, tokenizer=False).model  # no C step for a dense model
    requests = [Request(0, (5, 6, 7, 5, 6, 7), 6, 0.0)]
    result = run_engine(dense, requests, EngineConfig(batch_cap=2, speculate=SpecConfig()))
    assert result.speculation["off"].startswith("no one-call decode path")
    assert len(result.requests[0].tokens) == 6
    with pytest.raises(GenerationError, match="prefix cache: expected a size >= 0 MiB"):
        EngineConfig(prefix_cache_mb=-1)


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
def test_batch_invariant_runs_cut_chunks_on_row_groups(int4: Path, act: str) -> None:
    """batch_invariant: every decode step row-invariant and every prefill chunk but a prompt's
    last starting on a multiple of 8, so each request is computed as `generate` computes it
    alone, bit for bit; prefill chunks under 8 tokens could not make progress and are refused."""
    model, requests, alone = _model_and_alone(int4, act)
    for config in (
        EngineConfig(batch_cap=8, chunk=20, batch_invariant=True),
        EngineConfig(batch_cap=3, chunk=16, batch_invariant=True, speculate=SpecConfig(),
                     prefix_cache_mb=64),
    ):  # fmt: skip
        result = run_engine(model, requests, config, clock=VirtualClock(step_s=1.0))
        assert [r.tokens for r in result.requests] == alone
        starts = [c.end - c.tokens for c in result.prefill_chunks]
        assert all(s % 8 == 0 for s in starts), starts
    with pytest.raises(GenerationError, match="expected >= 8 tokens with batch invariance"):
        EngineConfig(chunk=4, batch_invariant=True)
