"""The continuous-batching engine on a tiny random model: every request gets the greedy tokens it
gets alone (staggered arrivals, different lengths, chunked prefill, static batching), TTFT counts
queueing, idle gaps are skipped, the admission limit rejects, and bad input is refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from quantkit.batching.engine import EngineConfig, RunResult, VirtualClock, run_engine
from quantkit.batching.workload import Request
from quantkit.errors import GenerationError
from quantkit.runtime.generate import generate
from quantkit.runtime.loader import LoadedModel, load_model
from quantkit.runtime.sampling import SamplingParams

# (prompt tokens, max new tokens, arrival in engine steps): arrivals staggered so that requests
# join while others decode, more requests than slots, prompts longer than the chunks below.
STAGGERED = [
    (5, 7, 0.0),
    (23, 4, 0.0),
    (3, 12, 2.5),
    (17, 9, 4.0),
    (40, 6, 9.0),
    (9, 10, 9.5),
    (31, 5, 10.0),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir, tokenizer=False)


def _requests(spec: list[tuple[int, int, float]], seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [
        # Ids from 3 up: 0-2 are special in the fixtures (2 is the config's eos).
        Request(i, tuple(torch.randint(3, 512, (n,), generator=g).tolist()), k, arrival)
        for i, (n, k, arrival) in enumerate(spec)
    ]


@pytest.fixture(scope="module")
def staggered(tiny: LoadedModel) -> tuple[list[Request], list[list[int]]]:
    requests = _requests(STAGGERED)
    alone = [
        generate(tiny.model, [r.prompt], SamplingParams(max_new_tokens=r.max_new_tokens)).tokens[0]
        for r in requests
    ]
    return requests, alone


def _run(tiny: LoadedModel, requests: list[Request], config: EngineConfig, **kw) -> RunResult:
    # One virtual second per forward: the same schedule on every machine.
    return run_engine(tiny.model, requests, config, clock=VirtualClock(step_s=1.0), **kw)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(batch_cap=3),
        EngineConfig(batch_cap=8),
        EngineConfig(batch_cap=1),
        EngineConfig(batch_cap=3, chunk=4),
        EngineConfig(batch_cap=2, chunk=7),
        EngineConfig(batch_cap=3, mode="static"),
    ],
    ids=["cont-3", "cont-8", "cont-1", "chunk-4", "chunk-7", "static-3"],
)
def test_same_greedy_tokens_as_each_request_alone(
    tiny: LoadedModel, staggered: tuple[list[Request], list[list[int]]], config: EngineConfig
) -> None:
    requests, alone = staggered
    result = _run(tiny, requests, config)
    assert [r.tokens for r in result.requests] == alone
    assert all(r.finish_reason == "length" for r in result.requests)
    assert max(s.rows for s in result.decode_steps) <= config.batch_cap
    # The cache is handed back: the model is as it was.
    assert all(layer.self_attn.cache is None for layer in tiny.model.model.layers)


def test_requests_join_and_leave_a_running_batch(
    tiny: LoadedModel, staggered: tuple[list[Request], list[list[int]]]
) -> None:
    requests, _ = staggered
    result = _run(tiny, requests, EngineConfig(batch_cap=3))
    first, late = result.requests[0], result.requests[2]
    # Request 2 arrives at 2.5 and gets its first token while request 0 is still decoding.
    assert first.token_times_s[0] < late.token_times_s[0] < first.token_times_s[-1]
    assert max(s.rows for s in result.decode_steps) == 3  # the cap is reached, then slots reused
    assert len({s.rows for s in result.decode_steps}) >= 3  # the batch grows and shrinks


def test_chunked_prefill_interleaves_with_decoding(
    tiny: LoadedModel, staggered: tuple[list[Request], list[list[int]]]
) -> None:
    requests, _ = staggered
    result = _run(tiny, requests, EngineConfig(batch_cap=3, chunk=4))
    assert max(c.tokens for c in result.prefill_chunks) == 4
    assert sum(c.tokens for c in result.prefill_chunks) == sum(len(r.prompt) for r in requests)
    # Request 4's 40-token prompt takes 10 chunks; request 3 keeps decoding meanwhile.
    long, running = result.requests[4], result.requests[3]
    during = [t for t in running.token_times_s if long.admitted_s < t < long.token_times_s[0]]
    assert len(during) >= 5
    whole = _run(tiny, requests, EngineConfig(batch_cap=3))
    assert all(c.tokens == c.end for c in whole.prefill_chunks)  # one forward per prompt


def test_static_batches_start_only_when_the_previous_one_is_done(
    tiny: LoadedModel, staggered: tuple[list[Request], list[list[int]]]
) -> None:
    requests, _ = staggered
    result = _run(tiny, requests, EngineConfig(batch_cap=3, mode="static"))
    for r in result.requests:
        earlier = [o for o in result.requests if o.admitted_s < r.admitted_s]
        assert all(o.finish_s <= r.admitted_s for o in earlier)
    # Finished rows ride along: some steps ran more rows than they decoded.
    assert any(s.window > s.rows for s in result.decode_steps)


def test_ttft_includes_queueing(tiny: LoadedModel) -> None:
    requests = _requests([(6, 4, 0.0), (6, 3, 0.0)])
    result = _run(tiny, requests, EngineConfig(batch_cap=1))
    one, two = result.requests
    # Step clock: prefill at t=1 (token 1), decodes at 2, 3, 4; the second waits for the slot.
    assert one.token_times_s == [1.0, 2.0, 3.0, 4.0]
    assert two.ttft_s == 5.0 and two.gaps_s == [1.0, 1.0]


def test_idle_time_is_skipped_on_the_wall_clock(tiny: LoadedModel) -> None:
    requests = _requests([(6, 3, 0.0), (6, 3, 3600.0)])
    start = time.perf_counter()
    result = run_engine(tiny.model, requests, EngineConfig(batch_cap=2))
    assert time.perf_counter() - start < 60  # an hour of nothing to do is not waited through
    late = result.requests[1]
    assert 0 < late.ttft_s < 30 and late.token_times_s[0] >= 3600.0


def test_admission_limit_rejects_beyond_it(tiny: LoadedModel) -> None:
    requests = _requests([(6, 3, 0.0)] * 4)
    result = _run(tiny, requests, EngineConfig(batch_cap=1, admission_limit=2))
    reasons = [r.finish_reason for r in result.requests]
    assert reasons == ["length", "length", "rejected", "rejected"]
    assert result.requests[2].tokens == [] and result.requests[3].token_times_s == []


def test_eos_ends_a_request_early(
    tiny: LoadedModel, staggered: tuple[list[Request], list[list[int]]]
) -> None:
    requests, alone = staggered
    eos = alone[2][5]
    result = _run(tiny, requests, EngineConfig(batch_cap=3), eos_ids={eos})
    for r, want in zip(result.requests, alone, strict=True):
        cut = want.index(eos) if eos in want else len(want)
        assert r.tokens == want[:cut]
        assert r.finish_reason == ("stop" if eos in want else "length")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"batch_cap": 0}, "batch cap: expected an integer >= 1, got 0"),
        ({"batch_cap": -2}, "batch cap: expected an integer >= 1, got -2"),
        ({"chunk": 0}, "prefill chunk: expected an integer >= 1"),
        ({"mode": "static", "chunk": 8}, "prefill chunk: expected continuous batching"),
        ({"admission_limit": 0}, "admission limit: expected an integer >= 1"),
        ({"mode": "orca"}, "mode: expected continuous or static, got 'orca'"),
    ],
)
def test_bad_engine_config(kwargs: dict, message: str) -> None:
    with pytest.raises(GenerationError, match=message):
        EngineConfig(**kwargs)


def test_bad_requests(tiny: LoadedModel) -> None:
    config = EngineConfig(batch_cap=2)
    too_long = _requests([(250, 10, 0.0)])
    with pytest.raises(GenerationError, match=r"prompt \+ max_new_tokens <= 256"):
        run_engine(tiny.model, too_long, config)
    with pytest.raises(GenerationError, match="expected a prompt of >= 1 token"):
        run_engine(tiny.model, [Request(0, (), 3, 0.0)], config)
    with pytest.raises(GenerationError, match=r"expected token ids in \[0, 512\)"):
        run_engine(tiny.model, [Request(0, (5, 900), 3, 0.0)], config)
    with pytest.raises(GenerationError, match="at least one request"):
        run_engine(tiny.model, [], config)
    with pytest.raises(GenerationError, match="no repetition penalty"):
        run_engine(
            tiny.model,
            _requests([(4, 2, 0.0)]),
            config,
            params=SamplingParams(repetition_penalty=1.2),
        )


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
def test_decode_steps_take_the_models_one_call_path(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, act: str
) -> None:
    """Also with bf16 activations in the GEMVs (`set_act_dtype`): the engine and `generate`
    alone share the mode, and every request still gets the tokens it gets alone."""
    from quantkit.format.scheme import QuantScheme
    from quantkit.fused_kernels.cpu.decode import CpuDecodeStep
    from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
    from quantkit.quantize.pipeline import quantize_model
    from quantkit.runtime.fast_path import ACT_DTYPES, bf16_activations_available, set_act_dtype

    if not cpu_kernel_available():
        pytest.skip("needs gcc for the C kernel (as tests/test_cpu_decode.py)")
    if act == "bfloat16" and not bf16_activations_available():
        pytest.skip("bf16 activations need a CPU with AVX512-BF16")
    outcome = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", "auto", False))
    ckpt = outcome.save(tmp_path / "int4", source_dir=tiny_llama_dir)
    model = load_model(ckpt, tokenizer=False).model
    set_act_dtype(model, ACT_DTYPES[act])
    requests = _requests([(7, 9, 0.0), (12, 6, 0.0), (4, 8, 20.0), (5, 7, 21.0), (9, 5, 21.0)])
    alone = [
        generate(model, [r.prompt], SamplingParams(max_new_tokens=r.max_new_tokens)).tokens[0]
        for r in requests
    ]
    rows = []
    original = CpuDecodeStep.__call__
    monkeypatch.setattr(
        CpuDecodeStep,
        "__call__",
        lambda self, x, *a, **k: rows.append(x.shape[0]) or original(self, x, *a, **k),
    )
    # chunk 4: prompts of 5-12 tokens span steps, some calls carry only unfinished chunks.
    for mode, chunk in (("continuous", None), ("continuous", 4), ("static", None)):
        rows.clear()
        config = EngineConfig(batch_cap=3, mode=mode, chunk=chunk)
        result = run_engine(model, requests, config, clock=VirtualClock(step_s=1))
        assert [r.tokens for r in result.requests] == alone, mode
        # Every call of the C step runs exactly its rows: a decode step's (with the prompt
        # rows it carried, continuous batching), and each prefill chunk that ran alone.
        prefilled = sum(c.tokens for c in result.prefill_chunks)
        carried = sum(s.prefill_tokens for s in result.decode_steps)
        windows = sum(s.window for s in result.decode_steps)
        assert sum(rows) == windows + prefilled - carried, mode
        assert len(rows) <= len(result.decode_steps) + len(result.prefill_chunks), mode
        if mode == "continuous":
            assert {1, 2} <= {s.rows for s in result.decode_steps}  # alone, shared
            # The later arrivals' prompts rode in the decode calls of the running requests.
            assert carried > 0 and all(s.window == s.rows + s.prefill_tokens
                                       for s in result.decode_steps)  # fmt: skip
        else:  # a static batch computes its finished rows until the last one is done
            assert carried == 0 and any(s.window > s.rows for s in result.decode_steps)
