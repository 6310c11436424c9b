"""NVFP4 and MXFP4 checkpoints as other engines read them: transformers + compressed-tensors
0.20.1 load what `save_checkpoint` writes and compute what quantkit computes, and
compressed-tensors' own compressor writes quantkit's bytes.

What the library does on CPU, pinned here:
- `CompressedTensorsConfig(dequantize=True)` loads both (and NVFP4 W4A4, as W4A16: the
  activation quantization is dropped) into fp32 models. Its FP4 decompression goes through
  bfloat16 (`unpack_fp4_from_uint8`'s default dtype), so NVFP4 weights arrive as quantkit's
  rounded to bf16 (MXFP4 values, a code times a power of two, are exact in bf16).
- The default (compressed) load runs in bfloat16, the activation rounding of W4A4 included; in
  float32 its first forward fails ("expected m1 and m2 to have the same dtype"): the weights are
  decompressed to bf16 whatever the model's dtype.
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
from quantkit.format.fp4 import e2m1_codes, e2m1_values, pack_fp4, unpack_fp4
from quantkit.format.mxfp4 import mx_exponents
from quantkit.format.nvfp4 import nvfp4_global_scale
from quantkit.format.scheme import QuantScheme
from quantkit.runtime.quant_linear import QuantLinear
from tests.interop_model import PROMPTS, tiny_llama

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

SCHEMES = {
    "nvfp4": QuantScheme("nvfp4"),
    "nvfp4-w4a4": QuantScheme("nvfp4", activations="dynamic"),
    "mxfp4": QuantScheme("mxfp4"),
}
PRESETS = {"nvfp4": "NVFP4A16", "nvfp4-w4a4": "NVFP4", "mxfp4": "MXFP4A16"}
# Linears that read one input, rounded together (NVFP4: one global scale, as vLLM needs).
INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


@pytest.fixture(autouse=True)
def _quantkit_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory):
    """(directory, model, input absmax of every decoder Linear over PROMPTS)."""
    directory = tmp_path_factory.mktemp("source")
    model = tiny_llama(directory)
    absmax: dict[str, float] = {}

    def hook(name: str):
        def record(_module, args) -> None:
            absmax[name] = max(absmax.get(name, 0.0), float(args[0].abs().max()))

        return record

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        for ids in PROMPTS:
            model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return directory, model, absmax


def quantize_and_save(source, scheme: QuantScheme, out: Path) -> LoadedCheckpoint:
    """RTN every decoder Linear, input groups together; W4A4 adds each Linear's calibrated
    input global scale (448 * 6 / the input absmax seen on PROMPTS, as llm-compressor's
    static_minmax observer)."""
    src_dir, model, absmax = source
    weights_only = QuantScheme(scheme.kind)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    modules = []
    for layer in range(model.config.num_hidden_layers):
        for group in INPUT_GROUPS:
            names = [f"model.layers.{layer}.{n}" for n in group]
            stored = scheme.format.round_and_store_group(
                [state[f"{n}.weight"] for n in names], weights_only, dtype=torch.float32
            )
            for name, local in zip(names, stored, strict=True):
                tensors.update({f"{name}.{k}": v for k, v in local.items()})
                if scheme.activations == "dynamic":
                    tensors[f"{name}.input_global_scale"] = nvfp4_global_scale(absmax[name])
                modules.append(name)
    quantized = {f"{m}.weight" for m in modules}
    tensors.update({k: v for k, v in state.items() if k not in quantized | {"lm_head.weight"}})
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


def quant_linear_model(source, loaded: LoadedCheckpoint):
    """The transformers model with quantkit's QuantLinears (reference kernel) in place."""
    model = transformers.LlamaForCausalLM(source[1].config).eval()
    model.load_state_dict(dequantize_checkpoint_tensors(loaded), strict=False)
    for prefix in loaded.quantized_modules:
        parent, _, child = prefix.rpartition(".")
        layer = QuantLinear.from_tensors(loaded.module_tensors(prefix), scheme=loaded.scheme)
        setattr(model.get_submodule(parent), child, layer)
    return model


def logits(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits.float() for ids in PROMPTS]


def max_rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b, strict=True))


def _hf(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", SCHEMES)
def test_config_is_the_compressed_tensors_preset(name: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    ours = scheme_to_quantization_config(SCHEMES[name])
    parsed = QuantizationConfig.model_validate(ours)  # the parser vLLM and transformers use
    assert parsed.format == f"{SCHEMES[name].kind}-pack-quantized"
    preset = preset_name_to_scheme(PRESETS[name], ["Linear"])
    # Written as compressed-tensors serialises its own preset, key for key...
    group = ours["config_groups"]["group_0"]
    for ours_entry, entry in (
        (group["weights"], preset.weights),
        (group["input_activations"], preset.input_activations),
    ):
        assert ours_entry == (None if entry is None else entry.model_dump(mode="json"))
    # ...and read back as the preset (zp_dtype, which symmetric schemes do not serialise, apart).
    parsed_group = parsed.config_groups["group_0"]
    for parsed_entry, entry in (
        (parsed_group.weights, preset.weights),
        (parsed_group.input_activations, preset.input_activations),
    ):
        if entry is None:
            assert parsed_entry is None
        else:
            assert parsed_entry.model_copy(update={"zp_dtype": None}) == entry.model_copy(
                update={"zp_dtype": None}
            )


# --------------------------------------------------------------------------- transformers


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("name", SCHEMES)
def test_transformers_dequantize_load(name: str, source, tmp_path: Path) -> None:
    from transformers import CompressedTensorsConfig

    loaded = quantize_and_save(source, SCHEMES[name], tmp_path / "ckpt")
    hf = _hf(
        tmp_path / "ckpt",
        quantization_config=CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
    )
    ours = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
    for prefix in loaded.quantized_modules:
        w = hf.get_submodule(prefix).weight
        want = ours[f"{prefix}.weight"]
        if SCHEMES[name].kind == "nvfp4":  # decompressed through bf16
            want = want.to(torch.bfloat16).float()
        assert w.dtype == torch.float32 and torch.equal(w, want), prefix
    # Logits against quantkit's fp32 weights (W4A16: dequantize=True drops W4A4's activation
    # rounding): exact for MXFP4, NVFP4's bf16-rounded weights measured 1.2e-3.
    reference = transformers.LlamaForCausalLM(source[1].config).eval()
    reference.load_state_dict(ours, strict=False)
    bound = 1e-6 if SCHEMES[name].kind == "mxfp4" else 5e-3
    assert max_rel_err(logits(hf), logits(reference)) <= bound
    # And the quantization really happened.
    assert max_rel_err(logits(hf), logits(source[1])) > 1e-3


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_transformers_compressed_load_bf16(name: str, source, tmp_path: Path) -> None:
    loaded = quantize_and_save(source, SCHEMES[name], tmp_path / "ckpt")
    hf = _hf(tmp_path / "ckpt", dtype=torch.bfloat16)
    got = logits(hf)  # the first forward decompresses
    ours = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
    for prefix in loaded.quantized_modules:
        w = hf.get_submodule(prefix).weight
        assert torch.equal(w, ours[f"{prefix}.weight"].to(torch.bfloat16)), prefix
    # A bf16 model against quantkit's fp32 one: measured 4.8e-3 (nvfp4), 3.4e-3 (mxfp4).
    assert max_rel_err(got, logits(quant_linear_model(source, loaded))) <= 2e-2


def test_transformers_compressed_load_fp32_fails_on_cpu(source, tmp_path: Path) -> None:
    quantize_and_save(source, SCHEMES["mxfp4"], tmp_path / "ckpt")
    hf = _hf(tmp_path / "ckpt", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"):
        logits(hf)


def test_w4a4_forward_matches_quant_linear(source, tmp_path: Path) -> None:
    """compressed-tensors' forward of the W4A4 checkpoint (the activations rounded to NVFP4 per
    group of 16 on the stored input_global_scale) computes QuantLinear's emulation exactly, once
    both run in fp32 on the same weights."""
    loaded = quantize_and_save(source, SCHEMES["nvfp4-w4a4"], tmp_path / "ckpt")
    hf = _hf(tmp_path / "ckpt", dtype=torch.bfloat16)
    logits(hf)  # decompress
    layer = hf.get_submodule(loaded.quantized_modules[0])
    assert layer.quantization_scheme.input_activations.dynamic == "local"
    # fp32 everywhere, quantkit's weights (not their bf16 copies): `.float()` is refused for a
    # quantized transformers model, so tensor by tensor.
    dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
    for name, p in hf.named_parameters():
        p.data = dense[name].clone() if name in dense else p.data.float()
    for module in hf.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.float()
    ours = logits(quant_linear_model(source, loaded))
    assert max_rel_err(logits(hf), ours) <= 1e-6
    # The activation rounding is there on both sides (W4A16 differs by several percent).
    w4a16 = transformers.LlamaForCausalLM(source[1].config).eval()
    w4a16.load_state_dict(dense, strict=False)
    assert max_rel_err(ours, logits(w4a16)) > 1e-2


# --------------------------------------------------------------------------- bit level


def test_nvfp4_compressor_writes_quantkit_bytes() -> None:
    """llm-compressor's path (observer min/max, `generate_gparam`, `calculate_qparams`, then the
    NVFP4 compressor) on an fp32 weight writes exactly what quantkit's RTN writes."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5], w[7, 16:32], w[9] = 1.5, 0.0, w[9] * 1e-6
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    g = generate_gparam(w.min(), w.max())
    groups = w.reshape(48, -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    theirs = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme
    )
    ours = SCHEMES["nvfp4"].format.round_and_store(w, SCHEMES["nvfp4"], dtype=torch.float32)
    assert theirs.keys() == ours.keys()
    for name, t in ours.items():
        other = theirs[name]
        assert t.dtype == other.dtype, name
        if t.dtype == torch.float8_e4m3fn:  # compared as bits
            t, other = t.view(torch.uint8), other.view(torch.uint8)
        assert torch.equal(t, other), name


def test_mxfp4_compressor_on_quantkit_scales_writes_quantkit_bytes() -> None:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    ours = SCHEMES["mxfp4"].format.round_and_store(w, SCHEMES["mxfp4"], dtype=torch.float32)
    scale = torch.exp2(ours["weight_scale"].float() - 127)  # 2^e, exact here (e well inside)
    theirs = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(theirs["weight_packed"], ours["weight_packed"])
    assert torch.equal(theirs["weight_scale"], ours["weight_scale"])
    back = MXFP4PackedCompressor.decompress(ours, scheme)["weight"]
    want = SCHEMES["mxfp4"].format.dequantize(ours, SCHEMES["mxfp4"], dtype=torch.float32)
    assert torch.equal(back.float(), want)


def test_mxfp4_scale_rule_differs_from_compressed_tensors_only_at_high_mantissas() -> None:
    """quantkit takes OCP's floor(log2(absmax)) - 2; compressed-tensors' quantizer first rounds
    absmax up to the next power of two when its mantissa is 1.75 or more (vLLM's reference_mxfp4
    "even" rule), so its exponent is one higher there and equal everywhere else."""
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    mantissas = torch.tensor([1.0, 1.25, 1.5, 1.7499, 1.75, 1.9, 1.999])
    absmax = torch.cat([mantissas * 2.0**e for e in (-20, -3, 0, 5)])
    groups = torch.zeros(len(absmax), 32)
    groups[:, 0] = absmax
    ours = mx_exponents(groups).reshape(-1) + 127
    theirs = generate_mx_scales(absmax).to(torch.int32)
    high = (absmax / torch.exp2(torch.floor(torch.log2(absmax)))) >= 1.75
    assert torch.equal(theirs, ours + high.to(torch.int32))


def test_fp4_packing_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import (
        pack_fp4_to_uint8,
        unpack_fp4_from_uint8,
    )

    codes = torch.randint(0, 16, (13, 40), generator=torch.Generator().manual_seed(3))
    codes = codes.to(torch.uint8)
    values = e2m1_values(codes)  # code 8 is -0.0
    assert torch.equal(pack_fp4_to_uint8(values), pack_fp4(codes))
    back = unpack_fp4_from_uint8(pack_fp4(codes), 13, 40, dtype=torch.float32)
    assert torch.equal(back, values)
    assert torch.equal(e2m1_codes(back), codes & ~((codes == 8).to(torch.uint8) << 3))
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
