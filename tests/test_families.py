"""A model family is one registry entry.

Every entry is self-consistent and names modules the decoder really has. And a new family
registered here as ONE entry, with nothing else edited (a Qwen2-like layer, q/k/v biases as data,
under its own model_type and GGUF architecture name), runs through the decoder (transformers'
Qwen2 is the oracle), fusion, the C decode step, the quantize pipeline and GGUF conversion.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from quantkit.errors import ModelSourceError
from quantkit.format.checkpoint import save_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.models import config as model_config
from quantkit.models import families
from quantkit.models.decoder import NORMS, CausalLM, ModelConfig, build_model
from quantkit.models.family import SHAPE_DIMS, Family, layer_part, shape_dims
from quantkit.models.llama import K_PROJ, LLAMA, Q_PROJ, V_PROJ
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.fusion import fuse_projections
from quantkit.sources import gguf as gguf_convert
from tests.conftest import TINY_LLAMA, make_hf_model

assert LLAMA.gguf is not None
# The new family: data only.
TOY = replace(
    LLAMA,
    model_types=("toyqwen",),
    biases=(Q_PROJ, K_PROJ, V_PROJ),
    bias_flags=None,
    gguf=replace(
        LLAMA.gguf,
        architectures=("toyqwen",),
        model_type="toyqwen",
        hf_architecture="Qwen2ForCausalLM",
        rope_permuted={},  # llama.cpp keeps Qwen2's q/k rows in the HF order
    ),
)
IDS = torch.randint(0, 512, (2, 23), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", autouse=True)
def _registered() -> Iterator[None]:
    """TOY in the registry for this module only: the one line a real family adds."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(families, "FAMILIES", (*families.FAMILIES, TOY))
        yield


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A tiny random transformers Qwen2 saved as a `toyqwen` model, and its logits on IDS."""
    import transformers

    overrides = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64}
    path = make_hf_model(tmp_path_factory.mktemp("toyqwen"), overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        want = ref.eval()(IDS).logits
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "toyqwen"}))
    return path, want


def _load(path: Path) -> CausalLM:
    config = json.loads((path / "config.json").read_text())
    return build_model(config, load_file(path / "model.safetensors"))


# --------------------------------------------------------------------------- every entry


@pytest.mark.parametrize("family", [*families.FAMILIES, TOY], ids=lambda f: f.name)
def test_entry_is_self_consistent(family: Family) -> None:
    linears, norms = set(family.linears), set(family.norms)
    assert len(linears) == len(family.linears)
    for group in (*family.scale_groups, *([family.v_to_o] if family.v_to_o else [])):
        assert set(group.linears) <= linears and group.prev in linears | norms, group
    assert set(family.no_clip) <= linears
    # GPTQ's input groups cover every Linear exactly once, in forward order.
    flat = [n for g in family.input_groups for n in g]
    assert Counter(flat) == Counter(family.linears) and tuple(flat) == family.linears
    # A fused matmul joins Linears that read one input, each in one fusion at most.
    fused = [n for f in family.fused for n in f.linears]
    assert len(fused) == len(set(fused))
    for f in family.fused:
        assert any(set(f.linears) <= set(g) for g in family.input_groups), f
    assert set(family.linear_dims) == linears
    assert {d for shape in family.linear_dims.values() for d in shape} <= set(SHAPE_DIMS)
    assert set(family.norms.values()) <= set(SHAPE_DIMS) and family.norm in NORMS
    assert set(family.biases) <= linears
    assert all(set(v) <= linears for v in (family.bias_flags or {}).values())
    if family.decode is not None:
        d = family.decode
        fused_or_stored = {f.into for f in family.fused} | linears  # Phi-3: stored fused
        assert d.qkv in fused_or_stored and d.o in linears
        assert {d.in_norm, d.post_norm} <= norms
        # the MLP: gate_up and down, or a mixture of experts (whose Linears are per model)
        assert (d.moe is None) == (family.moe is None)
        if d.moe is None:
            assert d.gate_up in fused_or_stored and d.down in linears
        else:
            assert d.moe == family.moe.block and d.gate_up is None and d.down is None
        extra = (d.q_norm, d.k_norm, d.attn_out_norm, d.ffn_out_norm)
        assert {n for n in extra if n is not None} <= norms
        assert (d.q_norm is None) == (d.k_norm is None) == (not family.qk_norm)
    if family.gguf is not None:
        # every Linear and norm, and a mixture of experts' router and each expert's Linears
        router = set() if family.moe is None else {f"{family.moe.block}.{family.moe.router}"}
        assert set(family.gguf.layer.values()) == linears | norms | router
        assert set(family.gguf.rope_permuted) <= set(family.gguf.layer)
        moe = family.moe
        expected = set() if moe is None else {moe.gate, moe.up, moe.down}
        assert set(family.gguf.experts.values()) == expected


def test_entries_do_not_overlap() -> None:
    everything = [*families.FAMILIES]
    types = [t for f in everything for t in f.model_types]
    assert len(types) == len(set(types))
    assert len(families.gguf_architectures()) == len(set(families.gguf_architectures()))


@pytest.mark.parametrize("family", [*families.FAMILIES, TOY], ids=lambda f: f.name)
@pytest.mark.parametrize("flags", [{}, {"attention_bias": True, "mlp_bias": True}])
def test_entry_names_the_decoders_modules(family: Family, flags: dict) -> None:
    config = {**TINY_LLAMA, "model_type": family.name, **flags}
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dict(config))
    assert model.family is family
    layer = model.model.layers[0]
    dims = shape_dims(hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32)
    biased = family.biased(config)
    for name in family.linears:
        linear = layer.get_submodule(name)
        out, inp = family.linear_dims[name]
        assert (linear.out_features, linear.in_features) == (dims[out], dims[inp]), name
        assert (linear.bias is not None) == (name in biased), name
    for name, size in family.norms.items():
        assert layer.get_submodule(name).weight.shape == (dims[size],)
    for group in family.scale_groups:
        assert isinstance(layer.get_submodule(group.inspect), nn.Module)
    for f in family.fused:
        assert layer_part(layer, f.into) is None  # the decoder's slot, empty until fused
    assert layer.get_submodule(family.attention) is not None


def test_unregistered_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(ModelSourceError, match="one of llama, mistral, qwen2, .*toyqwen .*'gemma'"):
        families.family_for({"model_type": "gemma"})


# --------------------------------------------------------------------------- a new family


def test_decoder_builds_it_and_matches_transformers(toy) -> None:
    path, want = toy
    model = _load(path)
    assert model.family is TOY
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), want, rtol=1e-4, atol=1e-4)


def test_fusion_fuses_it(toy) -> None:
    path, want = toy
    model = _load(path)
    assert fuse_projections(model) == 2 * len(TOY.fused)
    fused = model.model.layers[1].self_attn.fused_qkv
    assert fused.valid() and fused.fused.bias is not None
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), want, rtol=1e-4, atol=1e-4)


def test_pipeline_quantizes_it_looking_the_family_up_once(toy, monkeypatch) -> None:
    path, want = toy
    lookups = []
    lookup = model_config.family_for
    monkeypatch.setattr(model_config, "family_for", lambda cfg: lookups.append(1) or lookup(cfg))
    samples = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(2))
    outcome = quantize_model(
        path,
        scheme=QuantScheme("int4", 32),
        algorithm="awq",
        samples=lambda: samples,
        awq=AwqConfig(grid=4, search_tokens=64, clip_tokens=32, batch_sequences=4),
    )
    assert len(lookups) == 1  # build_model; the pipeline, AWQ and the walk read model.family
    assert outcome.quantized_modules == [
        f"model.layers.{i}.{name}" for i in range(2) for name in TOY.linears
    ]
    assert "model.layers.0.self_attn.v_proj.bias" in outcome.tensors
    assert "model.layers.0.self_attn.o_proj.bias" not in outcome.tensors
    runtime = outcome.runtime_model()
    dense = build_model(outcome.config, outcome.dense_state())
    with torch.no_grad():
        got = runtime(IDS)
        torch.testing.assert_close(got, dense(IDS), rtol=1e-4, atol=1e-4)
    # INT4 of a random model: close to the original, not equal.
    assert float((got - want).pow(2).mean() / want.pow(2).mean()) < 0.05


def test_c_decode_step_runs_it(toy, tmp_path: Path, monkeypatch) -> None:
    from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
    from quantkit.runtime.generate import generate
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.sampling import SamplingParams

    if not cpu_kernel_available():
        pytest.skip("needs gcc for the C kernel")
    path, _ = toy
    outcome = quantize_model(path, scheme=QuantScheme("int4", 32))
    ckpt = save_checkpoint(
        tmp_path / "ckpt", source_dir=path, config=outcome.config, tensors=outcome.tensors,
        scheme=outcome.scheme, algorithm=outcome.algorithm,
        quantized_modules=outcome.quantized_modules, report={},
    )  # fmt: skip
    model = load_model(ckpt, tokenizer=False).model
    model.setup_cache(batch=1, max_len=32)
    assert model.decode_path.reason == "bound"
    model.drop_cache()
    params = SamplingParams(max_new_tokens=8)
    fast = generate(model, [[5, 17, 99, 3]], params)
    monkeypatch.setenv("QUANTKIT_CPU_DECODE", "0")
    assert generate(model, [[5, 17, 99, 3]], params).tokens == fast.tokens


def test_gguf_of_it_converts(toy, tmp_path: Path, monkeypatch) -> None:
    """A GGUF with architecture `toyqwen` written from the HF weights converts back to them."""
    import gguf

    path, _ = toy
    config = json.loads((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    assert TOY.gguf is not None
    to_gguf = {hf: g for g, hf in TOY.gguf.layer.items()}
    writer = gguf.GGUFWriter(str(tmp_path / "toy.gguf"), "toyqwen")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(ModelConfig.from_dict(config).rope.theta)
    for name, t in state.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            index, local = stem.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{index}.{to_gguf[local]}.{kind}"
        else:
            gguf_name = {hf: g for g, hf in TOY.gguf.globals.items()}[stem] + f".{kind}"
        writer.add_tensor(gguf_name, t.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(gguf_convert, "_save_gguf_tokenizer", lambda *a, **k: None)
    out = gguf_convert.convert_gguf(tmp_path / "toy.gguf", tmp_path / "out", progress=False)
    converted = json.loads((out / "config.json").read_text())
    assert (converted["model_type"], converted["architectures"]) == (
        "toyqwen",
        ["Qwen2ForCausalLM"],
    )
    got = load_file(out / "model.safetensors")
    assert set(got) == set(state)
    for name, t in state.items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name
    assert build_model(converted, got).family is TOY
