"""Prompt-lookup speculative decoding: drafts, the acceptance rule, the policy, and generate's
output with it equal to plain decoding (greedy) or distributed as plain sampling."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from quantkit.errors import GenerationError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.generate import encode_prompt, eos_token_ids, generate
from quantkit.runtime.loader import load_model
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.prefix_cache import PrefixCache
from quantkit.runtime.sampling import SamplingParams, logits_to_probs
from quantkit.runtime.speculate import (
    CallTimes,
    DraftPolicy,
    NgramDrafter,
    SpecConfig,
    accept,
    parse_speculate,
    plan_drafts,
)

_REAL_HOME = os.environ.get("QUANTKIT_HOME")
needs_c = pytest.mark.skipif(not cpu_kernel_available(), reason="needs gcc for the C kernel")


# --------------------------------------------------------------------------- drafting


def test_drafter_proposes_what_followed_the_longest_earlier_match() -> None:
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3], SpecConfig(k=3, min_n=2, max_n=3))
    assert d.propose(3) == [4, 5, 9]  # "2 3" was followed by 4 5 9
    d.extend([7])
    assert d.propose(3) == []  # "3 7" and "2 3 7" never seen
    d.extend([1, 2, 3])  # "1 2 3" (n=3) occurred at the start: the longest match wins
    assert d.propose(2) == [4, 5]  # "1 2 3" (n = 3) beats the later "2 3" (followed by 7)
    loop = NgramDrafter([4, 6, 1, 2, 1, 2], SpecConfig(k=5))
    assert loop.propose(5) == [1, 2, 1, 2, 1]  # "1 2" -> "1 2" runs into the end: periodic
    longest = NgramDrafter([5, 1, 2, 3, 8, 6, 2, 3, 9, 1, 2, 3], SpecConfig(k=2, max_n=3))
    assert longest.propose(2) == [8, 6]  # "1 2 3" -> 8 beats the later "2 3" -> 9


def test_parse_speculate() -> None:
    assert parse_speculate(None) is None and parse_speculate("off") is None
    assert parse_speculate("ngram") == SpecConfig()
    assert parse_speculate("ngram:7").k == 7
    for bad in ("ngram:0", "ngram:99", "eagle", "ngram:x"):
        with pytest.raises(GenerationError, match="speculate: expected"):
            parse_speculate(bad)


# --------------------------------------------------------------------------- acceptance


def test_greedy_accepts_the_matching_prefix_then_the_argmax() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams()
    assert accept(logits, [3, 1, 4], params, generator=gen) == ([3, 1, 4, 2], 3)  # + bonus
    assert accept(logits, [3, 0, 4], params, generator=gen) == ([3, 1], 1)  # corrected
    assert accept(logits[:1], [], params, generator=gen) == ([3], 0)
    with pytest.raises(GenerationError, match=r"expected logits \[3, V\] for 2 drafts"):
        accept(logits, [3, 1], params, generator=gen)


def test_sampled_acceptance_keeps_the_distribution() -> None:
    """Rejection sampling with a one-token draft must emit token 1 ~ p0 and, after an accepted
    draft, token 2 ~ p1: 40,000 draws against the exact probabilities. Each frequency's
    standard error is sqrt(p (1 - p) / N) <= 0.0025; a 5-sigma bound fails a correct rule with
    probability ~1e-6 per cell, and catches an always-accept rule (p0(d) = 0.1, +0.9 off) or a
    residual that keeps d (+0.1 * p0(d) off at d) many times over."""
    logits = torch.tensor([[0.0, 1.0, -1.0, 0.5, -2.0], [1.0, -0.5, 0.0, 0.2, 0.3]])
    params = SamplingParams(temperature=0.8, top_k=4)
    p = logits_to_probs(logits, params)
    gen = torch.Generator().manual_seed(1234)
    n, draft = 40_000, 3  # a plausible, not the likeliest, draft
    first = torch.zeros(5)
    second = torch.zeros(5)
    for _ in range(n):
        out, accepted = accept(logits, [draft], params, generator=gen)
        first[out[0]] += 1
        if accepted:
            second[out[1]] += 1
    for freq, probs, count in ((first, p[0], n), (second, p[1], int(second.sum()))):
        se = torch.sqrt(probs * (1 - probs) / count).clamp_min(1e-4)
        assert ((freq / count - probs).abs() <= 5 * se).all(), (freq / count, probs)
    assert first[4] == 0  # top-k removed it: never emitted, by either path
    assert abs(second.sum() / n - p[0, draft]) < 0.01  # accepted with probability p0(d)


# --------------------------------------------------------------------------- policy


def test_policy_drafts_when_accepted_and_switches_off_when_not() -> None:
    times = CallTimes()
    for rows, ms in ((1, 10.0), (2, 13.0), (3, 15.0), (4, 23.0), (5, 29.0)):
        times.add(rows, ms, verify=True)
    policy = DraftPolicy(SpecConfig(k=4), times)
    for _ in range(30):
        policy.observe(4, 4)
    assert policy.length(4) >= 2 and policy.length(1) == 1
    for _ in range(30):
        policy.observe(2, 0)
    assert policy.length(4) == 0  # free-form text: drafting off
    for _ in range(30):
        policy.observe(1, 1)  # the shadow checks come back right
    assert policy.length(4) >= 1
    fixed = DraftPolicy(SpecConfig(k=3, adaptive=False))
    assert fixed.length(5) == 3 and fixed.length(2) == 2
    assert CallTimes().estimate(3, verify=True) > CallTimes().estimate(1, verify=True)


def test_plan_drafts_spends_rows_where_acceptance_is_high() -> None:
    times = CallTimes()
    for rows in range(1, 17):  # a step costs 10 ms + 1 ms a row, plain or verifying
        times.add(rows, 0.010 + 0.001 * rows, verify=False)
        times.add(rows, 0.010 + 0.001 * rows, verify=True)
    sure, never = DraftPolicy(SpecConfig(k=4), times), DraftPolicy(SpecConfig(k=4), times)
    sure.accept_rate, never.accept_rate = 0.95, 0.05
    assert plan_drafts([sure, never], [4, 4], times) == [4, 0]
    assert plan_drafts([sure, never], [2, 4], times) == [2, 0]  # only what was proposed
    assert plan_drafts([never], [4], times) == [0]


# --------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def tiny_int4(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    outcome = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", "auto", False))
    return outcome.save(tmp_path_factory.mktemp("spec") / "int4", source_dir=tiny_llama_dir)


# A random model's greedy output loops, so prompt lookup finds drafts in it.
PROMPTS = [[5, 17, 99, 3, 250, 31, 5, 17, 99], [7, 8, 9, 7, 8], [300, 301, 302, 303] * 3]


@needs_c
@pytest.mark.parametrize("act", ["float32", "bfloat16"])
def test_greedy_speculation_is_token_identical(tiny_int4: Path, act: str) -> None:
    from quantkit.runtime.fast_path import bf16_activations_available

    if act == "bfloat16" and not bf16_activations_available():
        pytest.skip("needs AVX512-BF16")
    model = load_model(tiny_int4, options=RuntimeOptions.cli(act_dtype=act), tokenizer=False).model
    verified = 0
    for prompt in PROMPTS:
        for params in (SamplingParams(max_new_tokens=40), SamplingParams(
            max_new_tokens=40, repetition_penalty=1.3
        )):  # fmt: skip
            plain = generate(model, [prompt], params)
            for config in (SpecConfig(k=4), SpecConfig(k=7, adaptive=False)):
                spec = generate(model, [prompt], params, speculate=config)
                assert spec.tokens == plain.tokens, (prompt, params, config)
                assert spec.finish_reasons == plain.finish_reasons
                assert spec.stats.generated_tokens == plain.stats.generated_tokens
                verified += spec.stats.speculation.verify_steps
    assert verified > 10  # drafts were verified, not only plain steps


@needs_c
def test_sampled_speculation_runs_and_respects_limits(tiny_int4: Path) -> None:
    model = load_model(tiny_int4, tokenizer=False).model
    params = SamplingParams(temperature=0.1, top_p=0.95, seed=3, max_new_tokens=33)
    out = generate(model, [PROMPTS[2]], params, speculate=SpecConfig(k=5, adaptive=False))
    assert len(out.tokens[0]) == 33 and out.finish_reasons == ["length"]
    assert all(0 <= t < 512 for t in out.tokens[0])
    spec = out.stats.to_dict()["speculation"]
    assert spec["verify_steps"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    # With nothing ever drafted (no 15-gram repeats), `accept` draws what `sample` draws:
    # the same tokens as plain sampling from the same seed.
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_new_tokens=40)
    never = SpecConfig(k=1, min_n=15, max_n=15)
    undrafted = generate(model, [[5, 6, 7, 8]], hot, speculate=never)
    assert undrafted.stats.speculation.verify_steps == 0
    assert undrafted.tokens == generate(model, [[5, 6, 7, 8]], hot).tokens


def test_speculation_refuses_batches_and_processors(tiny_int4: Path) -> None:
    model = load_model(tiny_int4, tokenizer=False).model
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(GenerationError, match="expected one prompt and no logits processors"):
        generate(model, PROMPTS[:2], params, speculate=SpecConfig())
    with pytest.raises(GenerationError, match="got 1 prompts and 1 processors"):
        generate(model, PROMPTS[:1], params, speculate=SpecConfig(), processors=[lambda i, x: x])


# --------------------------------------------------------------------------- prefix cache


@needs_c
def test_prefix_cache_in_generate_skips_prefill_and_keeps_outputs(tiny_int4: Path) -> None:
    model = load_model(tiny_int4, tokenizer=False).model
    params = SamplingParams(max_new_tokens=12)
    system = list(range(40, 40 + 21))  # 21 tokens: ends mid-block (block 8)
    prompts = [system + [7, 8, 9], system + [100], system[:10] + [3, 3]]
    plain = [generate(model, [p], params).tokens for p in prompts]
    cache = PrefixCache(64 << 20, block=8)
    first = generate(model, [prompts[0]], params, prefix_cache=cache)
    assert first.tokens == plain[0] and first.stats.prefill_skipped == 0
    second = generate(model, [prompts[1]], params, prefix_cache=cache)
    assert second.tokens == plain[1]
    assert second.stats.prefill_skipped == 16  # two whole blocks of the 21 shared tokens
    third = generate(model, [prompts[2]], params, prefix_cache=cache)
    assert third.tokens == plain[2] and third.stats.prefill_skipped == 8
    batch = generate(model, prompts[:2], params, prefix_cache=cache)  # a batch: both rows hit
    assert batch.tokens == generate(model, prompts[:2], params).tokens
    assert batch.stats.prefill_skipped == 2 * 16
    both = generate(model, [prompts[0]], params, prefix_cache=cache, speculate=SpecConfig())
    assert both.tokens == plain[0]
    assert cache.stats.hits == 5 and cache.bytes <= cache.budget_bytes


# --------------------------------------------------------------------------- embedded model


@pytest.fixture(scope="module")
def embedded_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct, RTN INT4 (seconds; AWQ would take minutes), from the shared
    cache of the dense model as the user has it."""
    from quantkit.sources.resolve import resolve_model

    old = os.environ.get("QUANTKIT_HOME")
    if _REAL_HOME is None:
        os.environ.pop("QUANTKIT_HOME", None)
    else:
        os.environ["QUANTKIT_HOME"] = _REAL_HOME
    try:
        src = resolve_model("smollm2-135m", progress=False)
    finally:
        if old is not None:
            os.environ["QUANTKIT_HOME"] = old
    outcome = quantize_model(src, scheme=QuantScheme("int4", "auto", False))
    return outcome.save(tmp_path_factory.mktemp("embedded") / "rtn", source_dir=src)


PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest."
)


@needs_c
def test_embedded_model_speculation_and_prefix_cache_are_lossless(embedded_int4: Path) -> None:
    loaded = load_model(embedded_int4, options=RuntimeOptions.cli())
    tok, model = loaded.tokenizer, loaded.model
    eos = eos_token_ids(tokenizer=tok, config=loaded.config, model_dir=loaded.path)
    params = SamplingParams(max_new_tokens=48)
    cache = PrefixCache(256 << 20)
    verified = accepted = 0
    for text in (
        f"{PASSAGE}\n\nRepeat the passage above exactly.",
        f"{PASSAGE}\n\nWhich continent is this passage about?",
        "Write a haiku about the sea.",
    ):
        ids = encode_prompt(tok, text)
        plain = generate(model, [ids], params, eos_ids=eos)
        for config in (SpecConfig(), SpecConfig(adaptive=False)):
            spec = generate(model, [ids], params, eos_ids=eos, speculate=config)
            assert spec.tokens == plain.tokens, (text, config)
        verified += spec.stats.speculation.verify_steps  # the fixed policy: always drafts
        accepted += spec.stats.speculation.accepted
        cached = generate(model, [ids], params, eos_ids=eos, prefix_cache=cache)
        assert cached.tokens == plain.tokens, text
    assert verified > 0 and accepted > 10
    assert cache.stats.hit_tokens >= 32  # the two passage prompts share template + passage
    assert math.isfinite(cache.stats.hit_rate())


@needs_c
def test_embedded_model_engine_reuse_is_batch_invariant(embedded_int4: Path) -> None:
    """The serving engine at cap 4, batch-invariant, with speculation and the prefix cache:
    every request gets exactly the tokens `generate` gives it alone on the embedded model."""
    from quantkit.batching.engine import EngineConfig, VirtualClock, run_engine
    from quantkit.batching.workload import Request

    loaded = load_model(embedded_int4, options=RuntimeOptions.cli())
    tok, model = loaded.tokenizer, loaded.model
    texts = [
        f"{PASSAGE}\n\nRepeat the passage above exactly.",
        f"{PASSAGE}\n\nHow many square kilometres does the rainforest cover?",
        "Write a haiku about the sea.",
        f"{PASSAGE}\n\nName the continent.",
    ]
    requests = [Request(i, tuple(encode_prompt(tok, t)), 24, 0.0) for i, t in enumerate(texts)]
    alone = [generate(model, [r.prompt], SamplingParams(max_new_tokens=24)).tokens[0]
             for r in requests]  # fmt: skip
    config = EngineConfig(
        batch_cap=4, chunk=32, batch_invariant=True, speculate=SpecConfig(adaptive=False),
        prefix_cache_mb=64,
    )  # fmt: skip
    result = run_engine(model, requests, config, clock=VirtualClock(step_s=1.0))
    assert [r.tokens for r in result.requests] == alone
    assert result.speculation["accepted_tokens"] > 0


@pytest.mark.parametrize("head", ["float32", "bfloat16"])
def test_row_invariant_logits_equal_one_row_calls(tiny_int4: Path, head: str) -> None:
    """The lm_head of a verification call: a BLAS GEMM picks its blocking by the row count,
    so row-invariant logits take such a head one row at a time; the C bf16 GEMV (rows share
    weight loads, never sums) takes up to 16 rows a call. Either way each row's logits are
    bit-identical to a one-row call's, for 40 rows."""
    from quantkit.cpu import has_bf16_dot
    from quantkit.runtime.head import logits_of_rows

    if head == "bfloat16" and not has_bf16_dot():
        pytest.skip("the C bf16 head needs AVX512-BF16")
    options = RuntimeOptions.cli(head_dtype=head)
    model = load_model(tiny_int4, options=options, tokenizer=False).model
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 1, model.config.hidden_size, generator=g)
    with torch.no_grad():
        one = torch.cat([model.logits(hidden[i : i + 1])[:, -1] for i in range(40)])
        assert torch.equal(logits_of_rows(model, hidden, row_invariant=True), one)
