"""The proof that another engine can serve a quantkit checkpoint: transformers + compressed-tensors
load what `save_checkpoint` writes and compute the same logits, and compressed-tensors' own
bit-packing agrees with quantkit's bit for bit.

A tiny random Llama (2 layers, hidden 128) is built in a fixture; nothing touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.format.checkpoint import (
    LoadedCheckpoint,
    dequantize_checkpoint_tensors,
    load_checkpoint,
    save_checkpoint,
    scheme_to_quantization_config,
)
from quantkit.format.fp8 import fp8_tensors
from quantkit.format.int4 import int4_tensors
from quantkit.format.packing import (
    int4_qparams,
    int4_quantize,
    pack_int4,
    pack_zero_points,
    quantize_fp8,
    unpack_int4,
    unpack_zero_points,
)
from quantkit.format.scheme import QuantScheme
from quantkit.runtime.quant_linear import QuantLinear
from tests.interop_model import PROMPTS, tiny_llama

transformers = pytest.importorskip("transformers")
ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")

SCHEMES = {
    "int4-asym-g32": QuantScheme("int4", group_size=32),
    "int4-sym-g64": QuantScheme("int4", group_size=64, symmetric=True),
    "int4-asym-channel": QuantScheme("int4", group_size=-1),
    "fp8-w8a16": QuantScheme("fp8"),
    "fp8-w8a8": QuantScheme("fp8", activations="dynamic"),
}
# Both sides dequantize to the same fp32 weights; the bound leaves room for kernel-order
# rounding in fp32 only (measured: 0.0 for every scheme here).
MAX_REL_ERR = 1e-3


@pytest.fixture(autouse=True)
def _quantkit_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory):
    """(directory, model): a tiny random LlamaForCausalLM saved as a plain HF directory."""
    directory = tmp_path_factory.mktemp("source")
    model = tiny_llama(directory)
    return directory, model


def quantize_and_save(source, scheme: QuantScheme, out: Path) -> LoadedCheckpoint:
    """RTN-quantize every decoder Linear with quantkit.format.packing, save, load back."""
    src_dir, model = source
    tensors: dict[str, torch.Tensor] = {}
    modules = []
    for name, t in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if name == "lm_head.weight":
            continue  # tied to the embedding: stored once, as transformers does
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            if scheme.kind == "int4":
                g = scheme.group_size
                scale, zero = int4_qparams(t, group_size=g, symmetric=scheme.symmetric)
                codes = int4_quantize(t, scale, zero, group_size=g)
                local = int4_tensors(codes, scale, zero, dtype=torch.float32)
            else:
                local = fp8_tensors(*quantize_fp8(t), dtype=torch.float32)
            tensors.update({f"{prefix}.{k}": v for k, v in local.items()})
            modules.append(prefix)
        else:
            tensors[name] = t
    assert len(modules) == 14  # 7 Linears x 2 layers
    save_checkpoint(
        out,
        source_dir=src_dir,
        config=json.loads((src_dir / "config.json").read_text()),
        tensors=tensors,
        scheme=scheme,
        algorithm="rtn",
        quantized_modules=modules,
        report={},
    )
    return load_checkpoint(out)


def dense_reference(source, loaded: LoadedCheckpoint):
    """A plain transformers model carrying quantkit's own dequantized weights."""
    _, model = source
    ref = transformers.LlamaForCausalLM(model.config).eval()
    result = ref.load_state_dict(dequantize_checkpoint_tensors(loaded), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]  # tied
    return ref


def quant_linear_model(source, loaded: LoadedCheckpoint):
    """The same model with every quantized Linear replaced by quantkit's QuantLinear."""
    ref = dense_reference(source, loaded)
    for prefix in loaded.quantized_modules:
        parent, _, child = prefix.rpartition(".")
        layer = QuantLinear.from_tensors(loaded.module_tensors(prefix), scheme=loaded.scheme)
        setattr(ref.get_submodule(parent), child, layer)
    return ref


def max_rel_err(a_model, b_model) -> float:
    worst = 0.0
    with torch.no_grad():
        for ids in PROMPTS:
            a = a_model(torch.tensor([ids])).logits
            b = b_model(torch.tensor([ids])).logits
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


# transformers warns that the checkpoint's own quantization_config wins over the one passed;
# only `dequantize` is taken from ours, which is the point.
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("name", SCHEMES)
def test_transformers_dequantize_load_matches(name: str, source, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    loaded = quantize_and_save(source, SCHEMES[name], tmp_path / "ckpt")
    # dequantize=True: the default load of asymmetric INT4 hits a zero-point-shape loader bug in
    # compressed-tensors >= 0.18 (see ARCHITECTURE.md); this path works on every version tried.
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt",
        quantization_config=CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
    ).eval()
    ref = dense_reference(source, loaded)
    assert max_rel_err(hf, ref) <= MAX_REL_ERR
    # The quantization really happened: the reference differs from the unquantized model.
    assert max_rel_err(ref, source[1]) > 1e-4
    # And transformers' weights are the original ones up to quantization error, which a wrong
    # on-disk layout (shared by both readers) would not be.
    w_hf = hf.model.layers[1].mlp.down_proj.weight
    w = source[1].model.layers[1].mlp.down_proj.weight
    # Measured relative error: int4 0.08-0.11, fp8 0.026.
    bound = 0.2 if SCHEMES[name].kind == "int4" else 0.05
    assert ((w_hf - w).norm() / w.norm()).item() < bound


@pytest.mark.parametrize("name", ["int4-sym-g64", "fp8-w8a16", "fp8-w8a8"])
def test_transformers_default_load_matches_quant_linear(name: str, source, tmp_path: Path) -> None:
    """The compressed load path (compressed-tensors' own forward, which for W8A8 also rounds the
    activations to fp8 per token) computes what QuantLinear computes."""
    from transformers import AutoModelForCausalLM

    loaded = quantize_and_save(source, SCHEMES[name], tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    # Measured 3.4e-7 for W8A8 (per-token scale rounding order), 0.0 otherwise.
    assert max_rel_err(hf, quant_linear_model(source, loaded)) <= MAX_REL_ERR
    if name == "fp8-w8a8":  # and the activation rounding is visible, so it was exercised
        assert max_rel_err(hf, dense_reference(source, loaded)) > 1e-3


@pytest.mark.parametrize("name", SCHEMES)
def test_config_is_what_compressed_tensors_expects(name: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = SCHEMES[name]
    ours = scheme_to_quantization_config(scheme)
    parsed = QuantizationConfig.model_validate(ours)  # the same parser vLLM and transformers use
    assert parsed.quantization_status == "compressed" and parsed.ignore == ["lm_head"]
    # Same weights/activations arguments as the library's own presets (presets default g128).
    preset = {
        "int4-asym-g32": "W4A16_ASYM",
        "int4-sym-g64": "W4A16",
        "int4-asym-channel": "W4A16_ASYM",
        "fp8-w8a16": "FP8_DYNAMIC",
        "fp8-w8a8": "FP8_DYNAMIC",
    }[name]
    expected = preset_name_to_scheme(preset, ["Linear"])
    group = parsed.config_groups["group_0"]
    for key in ("num_bits", "type", "symmetric", "dynamic"):
        assert getattr(group.weights, key) == getattr(expected.weights, key), key
    strategy = "channel" if scheme.group_size == -1 else "group"
    assert group.weights.strategy == strategy
    if name == "fp8-w8a8":
        assert group.input_activations == expected.input_activations
    else:
        assert group.input_activations is None


# --------------------------------------------------------------------------- bit level


def test_int4_packing_matches_compressed_tensors() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-8, 8, (37, 100), generator=gen, dtype=torch.int8)  # K % 8 != 0
    packed = pack_int4(codes)
    ct_packed = ct_helpers.pack_to_int32(codes, 4)
    assert torch.equal(packed, ct_packed)
    ct_codes = ct_helpers.unpack_from_int32(packed, 4, torch.Size([37, 100]))
    assert torch.equal(ct_codes, unpack_int4(packed, 100))
    assert torch.equal(ct_codes, codes)


def test_zero_point_packing_matches_compressed_tensors() -> None:
    gen = torch.Generator().manual_seed(2)
    zero = torch.randint(-8, 8, (13, 5), generator=gen, dtype=torch.int8)  # N % 8 != 0
    packed = pack_zero_points(zero)
    assert packed.shape == (2, 5)
    assert torch.equal(packed, ct_helpers.pack_to_int32(zero, 4, packed_dim=0))
    ct_zero = ct_helpers.unpack_from_int32(packed, 4, torch.Size([13, 5]), packed_dim=0)
    assert torch.equal(ct_zero.to(torch.int32), unpack_zero_points(packed, 13))
    assert torch.equal(ct_zero, zero)


def _signed(word: int) -> int:
    """The int32 that has the bit pattern of uint32 `word`."""
    return word - (1 << 32) if word >= 1 << 31 else word


@pytest.mark.parametrize(
    ("codes", "word"),
    [
        # nibble = code + 8, element j at bits 4j: nibbles 8..15 read high to low = F..8.
        ([0, 1, 2, 3, 4, 5, 6, 7], 0xFEDCBA98),
        # nibbles [0, F, 8, 7, B, 4, D, 2] -> high to low 2 D 4 B 7 8 F 0.
        ([-8, 7, 0, -1, 3, -4, 5, -6], 0x2D4B78F0),
    ],
)
def test_hand_computed_word(codes: list[int], word: int) -> None:
    row = torch.tensor([codes], dtype=torch.int8)
    expected = torch.tensor([[_signed(word)]], dtype=torch.int32)
    assert torch.equal(pack_int4(row), expected)
    assert torch.equal(ct_helpers.pack_to_int32(row, 4), expected)
    # The same 8 values as one zero-point column of 8 rows pack to the same word.
    assert torch.equal(pack_zero_points(row.T), expected)
