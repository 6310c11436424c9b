"""Fused projections and the one-call CPU decode step compute what the PyTorch path computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.decode import CpuDecodeStep, DecoderDims
from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
from quantkit.models.decoder import CausalLM, build_model
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.fusion import fuse_projections
from quantkit.runtime.generate import generate
from quantkit.runtime.loader import load_model
from quantkit.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="needs gcc for the C kernel")

PROMPTS = [[5, 17, 99, 3, 250, 31], [7, 8]]


def _int4_checkpoint(src: Path, out: Path, *, group: int | str = "auto", sym: bool = False):
    outcome = quantize_model(src, scheme=QuantScheme("int4", group, sym))
    return outcome.save(out, source_dir=src)


@pytest.fixture(scope="module")
def llama_ckpt(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _int4_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("ckpt") / "int4")


def _greedy(model, prompt: list[int], n: int = 12):
    return generate(model, [prompt], SamplingParams(max_new_tokens=n))


def test_fast_path_binds_and_matches_torch(llama_ckpt: Path, monkeypatch) -> None:
    model = load_model(llama_ckpt, tokenizer=False).model
    model.setup_cache(batch=1, max_len=64)
    assert model.decode_path.reason == "bound"
    model.drop_cache()
    calls = []
    original = CpuDecodeStep.__call__
    monkeypatch.setattr(
        CpuDecodeStep, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    for prompt in PROMPTS:
        fast = _greedy(model, prompt)
        assert len(calls) == 12  # the prefill, then every decode step
        calls.clear()
        monkeypatch.setenv("QUANTKIT_CPU_DECODE", "0")
        slow = _greedy(model, prompt)
        monkeypatch.delenv("QUANTKIT_CPU_DECODE")
        assert fast.tokens == slow.tokens


def test_fast_step_logits_match(llama_ckpt: Path) -> None:
    model = load_model(llama_ckpt, tokenizer=False).model
    with torch.no_grad():
        model.setup_cache(batch=1, max_len=32)
        ids = torch.tensor([PROMPTS[0]])
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        model(ids, positions=pos, mask=(torch.arange(32) <= pos[0, :, None]).view(1, 1, -1, 32))
        step = dict(positions=torch.tensor([[6]]), mask=(torch.arange(32) <= 6).view(1, 1, 1, 32))
        fast = model(torch.tensor([[42]]), **step)
        path, model.decode_path = model.decode_path, None
        slow = model(torch.tensor([[42]]), **step)  # rewrites the same cache slot
        model.decode_path = path
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_qwen2_biases_and_symmetric_per_channel(tmp_path: Path) -> None:
    src = make_hf_model(
        tmp_path / "qwen2",
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64},
    )
    ckpt = _int4_checkpoint(src, tmp_path / "ckpt", group=-1, sym=True)
    model = load_model(ckpt, tokenizer=False).model
    assert model.model.layers[0].self_attn.fused_qkv.fused.bias is not None
    fast = _greedy(model, PROMPTS[0])
    model.decode_path = None
    assert fast.tokens == _greedy(model, PROMPTS[0]).tokens


def test_batched_step_matches_torch_rows_at_own_slots_and_positions(llama_ckpt: Path) -> None:
    """Rows of different lengths in one call, at cache rows in any order: each row's hidden
    state equals the PyTorch layers' (which attend under the mask slots <= position)."""
    model = load_model(llama_ckpt, tokenizer=False).model
    s = 32
    lengths = [3, 9, 1, 6]
    with torch.no_grad():
        model.setup_cache(batch=4, max_len=s)
        assert model.decode_path.reason == "bound"
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, 512, (4, max(lengths)), generator=g)
        pos = torch.arange(ids.shape[1]).expand(4, -1)
        mask = (torch.arange(s) <= pos[:1, :, None]).unsqueeze(1)
        model(ids, positions=pos, mask=mask)  # prefill every row (pads write beyond lengths)
        tokens, positions, slots = [42, 7, 99, 300], lengths, [2, 0, 3, 1]
        fast = model.decode_path.run_rows(model, tokens, positions, slots)
        order = sorted(range(4), key=lambda r: slots[r])  # rows by cache row, for the mask
        fed = torch.tensor([[tokens[r]] for r in order])
        at = torch.tensor([[positions[r]] for r in order])
        path, model.decode_path = model.decode_path, None
        x = model.model.embed_tokens(fed)
        cos, sin = model.rope(at)
        step_mask = (torch.arange(s) <= at).view(4, 1, 1, s)
        for layer in model.model.layers:  # rewrites the same cache positions
            x = layer(x, cos, sin, positions=at, mask=step_mask)
        model.decode_path = path
    torch.testing.assert_close(fast[order], x, rtol=1e-5, atol=1e-5)


def test_prefill_through_the_step_matches_torch(llama_ckpt: Path) -> None:
    """One row's T tokens in one call (rows sharing a cache row): a causal prefill, then a
    second chunk on top of it; logits equal the PyTorch layers'."""
    model = load_model(llama_ckpt, tokenizer=False).model
    ids = torch.tensor([PROMPTS[0] + PROMPTS[0][:4]])
    s = 32
    out = {}
    for fast in (True, False):
        if not fast:
            model.decode_path = None
        with torch.no_grad():
            model.setup_cache(batch=1, max_len=s)
            chunks = []
            for lo, hi in ((0, 5), (5, ids.shape[1])):
                pos = torch.arange(lo, hi).unsqueeze(0)
                mask = (torch.arange(s) <= pos[0, :, None]).view(1, 1, hi - lo, s)
                chunks.append(model(ids[:, lo:hi], positions=pos, mask=mask))
        out[fast] = torch.cat(chunks, dim=1)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


def test_batched_generate_matches_torch(llama_ckpt: Path, monkeypatch) -> None:
    model = load_model(llama_ckpt, tokenizer=False).model
    calls = []
    original = CpuDecodeStep.__call__
    monkeypatch.setattr(
        CpuDecodeStep,
        "__call__",
        lambda self, x, *a, **k: calls.append(x.shape[0]) or original(self, x, *a, **k),
    )
    prompts = [PROMPTS[0], PROMPTS[0][:3], PROMPTS[0][1:]]
    fast = generate(model, prompts, SamplingParams(max_new_tokens=10))
    assert calls == [3] * 9  # every decode step of the batch, all rows in one call (a batch's
    # right-padded prefill takes the PyTorch path)
    monkeypatch.setenv("QUANTKIT_CPU_DECODE", "0")
    slow = generate(model, prompts, SamplingParams(max_new_tokens=10))
    assert fast.tokens == slow.tokens


def test_not_bound_for_dense_or_unfused(llama_ckpt: Path, tiny_llama_dir: Path) -> None:
    model = load_model(llama_ckpt, tokenizer=False).model
    # Replacing a part's tensor invalidates its fused group: the model falls back.
    layer = model.model.layers[0].self_attn
    layer.k_proj.weight_packed = layer.k_proj.weight_packed.clone()
    assert not layer.fused_qkv.valid()
    model.setup_cache(batch=1, max_len=16)
    assert model.decode_path.step is None and "not fused" in model.decode_path.reason
    dense = load_model(tiny_llama_dir, tokenizer=False).model
    dense.setup_cache(batch=1, max_len=16)
    assert dense.decode_path.step is None and "not INT4" in dense.decode_path.reason


def test_fusion_keeps_state_dict_and_outputs(tiny_llama_dir: Path, llama_ckpt: Path) -> None:
    for spec in (tiny_llama_dir, llama_ckpt):
        model = load_model(spec, tokenizer=False).model  # fused by the loader
        fused_state = {k: v.clone() for k, v in model.state_dict().items()}
        ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            fused_out = model(ids)
            for layer in model.model.layers:
                object.__setattr__(layer.self_attn, "fused_qkv", None)
                object.__setattr__(layer.mlp, "fused_gate_up", None)
            torch.testing.assert_close(fused_out, model(ids), rtol=1e-5, atol=1e-5)
        assert fuse_projections(model) == 2 * len(model.model.layers)
        assert fused_state.keys() == model.state_dict().keys()
        for k, v in model.state_dict().items():
            assert torch.equal(v, fused_state[k]), k


def test_dense_fusion_shares_memory(tiny_llama_dir: Path) -> None:
    from quantkit.sources.resolve import load_state_dict, read_config

    model = build_model(read_config(tiny_llama_dir), load_state_dict(tiny_llama_dir))
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    fused = attn.fused_qkv.fused.weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.out_features :].data_ptr()


def test_decode_step_rejects_mismatched_layers(llama_ckpt: Path) -> None:
    model = load_model(llama_ckpt, tokenizer=False).model
    model.setup_cache(batch=1, max_len=16)
    cfg = model.config
    good = DecoderDims(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        cfg.intermediate_size, cfg.rms_norm_eps,
    )  # fmt: skip
    parts = model.decode_path.step._keep
    wrong = DecoderDims(good.hidden, good.heads, good.kv_heads, good.head_dim, 999, good.eps)
    with pytest.raises(ValueError, match=r"layer 0 gate_up \[N, K\]: expected \(1998"):
        CpuDecodeStep(parts, wrong)
    step = CpuDecodeStep(parts, good)
    x = torch.zeros(1, cfg.hidden_size)
    cos = sin = torch.zeros(1, cfg.head_dim)
    with pytest.raises(ValueError, match="position: expected 0 to 15, got 16"):
        step(x, [16], cos, sin)
    with pytest.raises(ValueError, match="x: expected 1 x 128 contiguous float32"):
        step(x.double(), [0], cos, sin)
    with pytest.raises(ValueError, match="slot: expected 0 to 0, got 1"):
        step(x, [0], cos, sin, slots=[1])
    two = torch.zeros(2, cfg.hidden_size)
    with pytest.raises(ValueError, match=r"no \(slot, position\) twice"):
        step(two, [3, 3], torch.zeros(2, cfg.head_dim), torch.zeros(2, cfg.head_dim), slots=[0, 0])


def test_int4_modules_deepcopy_after_use(llama_ckpt: Path) -> None:
    import copy

    model = load_model(llama_ckpt, tokenizer=False).model
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        out = model(ids)
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(ids), out)


def test_act_dtype_is_checked_and_rebinds(llama_ckpt: Path, tiny_llama_dir: Path) -> None:
    """set_act_dtype: only fp32/bf16; bf16 only where the C step runs the model (INT4) on an
    AVX512-BF16 CPU; a change rebinds the bound step; auto picks bf16 only for such a model."""
    from quantkit.errors import GenerationError
    from quantkit.runtime.fast_path import (
        auto_act_dtype,
        bf16_activations_available,
        bf16_activations_faster,
        int8_activations_faster,
        set_act_dtype,
    )

    model = load_model(llama_ckpt, tokenizer=False).model
    dense = load_model(tiny_llama_dir, tokenizer=False).model
    with pytest.raises(GenerationError, match="one of float32, bfloat16, int8, got torch.float16"):
        set_act_dtype(model, torch.float16)
    with pytest.raises(GenerationError, match="got layer 0: a Linear is not INT4"):
        set_act_dtype(dense, torch.bfloat16)
    assert auto_act_dtype(dense, quantized=False) == torch.float32
    # auto: int8 where measured faster (Intel with VNNI), else bf16 where it was (AMD)
    want = torch.bfloat16 if bf16_activations_faster() else torch.float32
    want = torch.int8 if int8_activations_faster() else want
    assert auto_act_dtype(model, quantized=True) == want
    if not bf16_activations_available():
        with pytest.raises(GenerationError, match="got a CPU without AVX512-BF16"):
            set_act_dtype(model, torch.bfloat16)
        return
    rel = _rebound_logits_error(model, torch.bfloat16)
    assert 0 < rel < 2e-2  # rounded operands: close, not equal


def test_act_precision_scores_windows_through_the_step(llama_ckpt: Path) -> None:
    """The perplexity benchmark's logits: one window as a causal prefill through the C step,
    equal to the PyTorch layers' logits (fp32 activations); a second window reuses the model."""
    from quantkit.evals.studies.act_precision import format_rows, step_logits

    model = load_model(llama_ckpt, tokenizer=False).model
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1] + PROMPTS[0]])
    with torch.inference_mode():
        fast = step_logits(model, ids)
        again = step_logits(model, ids[:, :5])
        model.drop_cache()
        slow = model(ids)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, slow[:, :5], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"expected one window \[1, T\]"):
        step_logits(model, ids.expand(2, -1))
    rows = [
        {"mode": "C step, fp32", "ppl": 20.0, "tokens": 100, "seconds": 1.0},
        {"mode": "C step, bf16 activations", "ppl": 20.02, "tokens": 100, "seconds": 0.5},
    ]
    assert "+0.100%" in format_rows(rows).splitlines()[2]


@pytest.mark.parametrize("act", ["float32", "bfloat16", "int8"])
def test_row_invariant_rows_equal_one_row_calls_bit_for_bit(llama_ckpt: Path, act: str) -> None:
    """Speculative decoding verifies k drafts in one call of k + 1 rows; with row_invariant
    each row's hidden state is bit-identical to the one-row call plain decoding makes, for any
    row count (pairs and a single, 8-row chunks without it)."""
    from quantkit.runtime.fast_path import (
        bf16_activations_available,
        int8_activations_available,
        set_act_dtype,
    )

    if act == "bfloat16" and not bf16_activations_available():
        pytest.skip("needs AVX512-BF16 for bf16 activations")
    if act == "int8" and not int8_activations_available():
        pytest.skip("needs AVX512-VNNI for int8 activations")
    model = load_model(llama_ckpt, tokenizer=False).model
    set_act_dtype(model, getattr(torch, act))
    prompt = [5, 17, 99, 3, 250, 31, 7, 8, 9, 10, 11, 12]
    with torch.no_grad():
        model.setup_cache(batch=2, max_len=64)
        path = model.decode_path
        for row in (0, 1):
            path.run_rows(model, prompt[:4], [0, 1, 2, 3], [row] * 4)
        for rows in (2, 3, 5, 8):
            one = torch.cat(
                [path.run_rows(model, [prompt[4 + i]], [4 + i], [0]) for i in range(rows)]
            )
            many = path.run_rows(
                model, prompt[4 : 4 + rows], list(range(4, 4 + rows)), [1] * rows,
                row_invariant=True,
            )  # fmt: skip
            assert torch.equal(one, many), f"{rows} rows"


def test_phase_timers_count_timed_steps_and_change_nothing(llama_ckpt: Path) -> None:
    from quantkit.evals.speed.decode_phases import measure, weight_bytes_by_phase
    from quantkit.fused_kernels.cpu.decode import PHASES, decode_phases

    model = load_model(llama_ckpt, tokenizer=False).model
    plain = _greedy(model, PROMPTS[0]).tokens
    decode_phases(True)
    timed = _greedy(model, PROMPTS[0]).tokens
    phases, steps = decode_phases(False)
    assert timed == plain  # the timers read a clock, nothing else
    assert steps == 12 and set(phases) == set(PHASES)  # the prefill and 11 decode steps
    assert phases.pop("route") == 0.0  # a dense model has no MoE layer to route
    assert all(s > 0 for s in phases.values()), phases
    _greedy(model, PROMPTS[0])
    assert decode_phases(False) == (dict.fromkeys(PHASES, 0.0), 0)  # off: nothing counted

    split = measure(model, PROMPTS[1], batch=2, new_tokens=6)
    assert split.steps == 5 and split.batch == 2  # decode steps only, not the prefill
    assert 0 < sum(split.phases.values()) <= split.step_call <= split.total
    assert 0 < split.head < split.total
    assert "run_rows" not in vars(model.decode_path) and "logits" not in vars(model)
    gemv = weight_bytes_by_phase(model)
    assert set(gemv) == {"qkv", "o", "gate_up", "down"} and all(b > 0 for b in gemv.values())
    assert gemv["gate_up"] == 2 * gemv["down"]  # gate and up: each the size of down


def _rebound_logits_error(model: CausalLM, dtype: torch.dtype) -> float:
    """Relative error of a prefill's logits once set_act_dtype(model, dtype) has rebound the
    step (checked: to the same cache, with the new dtype), against fp32 activations'."""
    from quantkit.runtime.fast_path import set_act_dtype

    model.setup_cache(batch=1, max_len=16)
    x = torch.tensor([PROMPTS[0]])
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    with torch.no_grad():
        fp32 = model(x, positions=pos)
        set_act_dtype(model, dtype)
        assert model.decode_path.step.act_dtype == dtype  # rebound to the same cache
        narrow = model(x, positions=pos)
    return ((narrow - fp32).norm() / fp32.norm()).item()


def test_int8_activations_step_is_close_to_fp32(llama_ckpt: Path) -> None:
    """int8 activations (VNNI): set_act_dtype rebinds the step; its logits stay close to the
    fp32 step's (int8 operands, int32 sums), and the prefill and decode both run it."""
    from quantkit.errors import GenerationError
    from quantkit.runtime.fast_path import int8_activations_available, set_act_dtype

    model = load_model(llama_ckpt, tokenizer=False).model
    if not int8_activations_available():
        with pytest.raises(GenerationError, match="got a CPU without AVX512-VNNI"):
            set_act_dtype(model, torch.int8)
        return
    rel = _rebound_logits_error(model, torch.int8)
    assert 0 < rel < 2e-2
    assert _greedy(model, PROMPTS[0]).tokens[0]  # decode steps run on it too


def test_auto_activations_follow_the_measured_vendor(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto_act_dtype's policy on any machine: int8 wherever the VNNI build exists (Intel and
    AMD), else bf16 on an AMD CPU with the BF16 build, else fp32."""
    import quantkit.cpu
    import quantkit.runtime.fast_path as fast_path

    model = load_model(llama_ckpt, tokenizer=False).model
    for vendor, int8, bf16, want in (
        ("GenuineIntel", True, True, torch.int8),
        ("GenuineIntel", False, True, torch.float32),  # bf16 measured slower on Intel
        ("AuthenticAMD", True, True, torch.int8),  # measured faster on Zen 4 too
        ("AuthenticAMD", False, True, torch.bfloat16),
        ("AuthenticAMD", False, False, torch.float32),
    ):
        monkeypatch.setattr(quantkit.cpu, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(fast_path, "int8_activations_available", lambda i=int8: i)
        monkeypatch.setattr(fast_path, "bf16_activations_available", lambda b=bf16: b)
        assert fast_path.auto_act_dtype(model, quantized=True) == want, vendor


def test_a_long_int8_prefill_runs_in_chunks_and_gives_the_one_call_bits(
    llama_ckpt: Path, monkeypatch
) -> None:
    """With int8 activations a one-row prefill longer than `max_rows` runs through the step in
    chunks of `max_rows` rows, each a causal prefill over the cache so far; integer sums and
    per-row attention make it the one call's bits. With fp32 activations it takes the PyTorch
    layers (the step declines)."""
    from quantkit.runtime.fast_path import int8_activations_available, set_act_dtype

    model = load_model(llama_ckpt, tokenizer=False).model
    ids = torch.randint(3, 200, (1, 21), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(21).unsqueeze(0)
    path = model.decode_path
    with torch.no_grad():
        model.setup_cache(batch=1, max_len=32)
        monkeypatch.setattr(path, "max_rows", 8)
        assert not path.chunks and path.run(model, ids, pos) is None  # fp32: PyTorch
        if not int8_activations_available():
            pytest.skip("needs AVX512-VNNI for int8 activations")
        set_act_dtype(model, torch.int8)
        path = model.decode_path
        model.setup_cache(batch=1, max_len=32)
        monkeypatch.setattr(path, "max_rows", 8)
        assert path.chunks
        chunked = path.run(model, ids, pos)
        monkeypatch.setattr(path, "max_rows", 1024)
        model.setup_cache(batch=1, max_len=32)
        whole = path.run(model, ids, pos)
    assert chunked is not None and chunked.shape == whole.shape == (1, 21, whole.shape[-1])
    assert torch.equal(chunked, whole)
    # only the last position wanted: the chunks before the last leave keys and values, the
    # last one's last row the same bits, the cache the same
    with torch.no_grad():
        caches = [layer.self_attn.cache.k.clone() for layer in model.model.layers]
        monkeypatch.setattr(path, "max_rows", 8)
        model.setup_cache(batch=1, max_len=32)
        last = path.run(model, ids, pos, last_only=True)
        after = [layer.self_attn.cache.k for layer in model.model.layers]
    assert last is not None and last.shape == (1, 1, whole.shape[-1])
    assert torch.equal(last, whole[:, -1:])
    assert all(torch.equal(a, b) for a, b in zip(after, caches, strict=True))
