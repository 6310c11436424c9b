"""W8A8 INT8 checkpoints in transformers + compressed-tensors, on the CPU.

What the library does with an `int-quantized` checkpoint, pinned: with `dequantize=True` it
computes with quantkit's own dequantized weights (no activation rounding); its default load
keeps the int8 weights and runs W8A8 in PyTorch, rounding each token's activations by its own
rule (scale absmax / 127.5, codes in [-128, 127]) where quantkit uses vLLM's (absmax / 127,
[-127, 127]): the same format, two rounding rules a hair apart.
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
)
from quantkit.format.scheme import QuantScheme
from quantkit.runtime.quant_linear import QuantLinear
from tests.interop_model import PROMPTS, tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SCHEME = QuantScheme("int8")


@pytest.fixture(autouse=True)
def _quantkit_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """(the tiny random Llama, its W8A8 INT8 checkpoint, loaded back)."""
    src = tmp_path_factory.mktemp("source")
    model = tiny_llama(src)
    tensors: dict[str, torch.Tensor] = {}
    modules = []
    for name, t in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if name == "lm_head.weight":
            continue  # tied
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            local = SCHEME.format.round_and_store(t, SCHEME, dtype=torch.float32)
            tensors.update({f"{prefix}.{k}": v for k, v in local.items()})
            modules.append(prefix)
        else:
            tensors[name] = t
    out = tmp_path_factory.mktemp("ckpt") / "int8"
    save_checkpoint(
        out,
        source_dir=src,
        config=json.loads((src / "config.json").read_text()),
        tensors=tensors,
        scheme=SCHEME,
        algorithm="rtn",
        quantized_modules=modules,
        report={},
    )
    return model, out, load_checkpoint(out)


def _dense(model, loaded: LoadedCheckpoint, *, rule=None):
    """transformers' Llama on quantkit's dequantized weights; `rule` rounds each quantized
    Linear's input first (a W8A8 emulation)."""
    ref = transformers.LlamaForCausalLM(model.config).eval()
    ref.load_state_dict(dequantize_checkpoint_tensors(loaded), strict=False)
    if rule is not None:
        for prefix in loaded.quantized_modules:
            ref.get_submodule(prefix).register_forward_pre_hook(lambda _m, a: (rule(a[0]),))
    return ref


def _compressed_tensors_rule(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    return (x / scale).round().clamp(-128, 127) * scale


def _quantkit(model, loaded: LoadedCheckpoint):
    ref = _dense(model, loaded)
    for prefix in loaded.quantized_modules:
        parent, _, child = prefix.rpartition(".")
        layer = QuantLinear.from_tensors(loaded.module_tensors(prefix), scheme=SCHEME)
        setattr(ref.get_submodule(parent), child, layer)
    return ref


def _max_rel_err(a_model, b_model) -> float:
    worst = 0.0
    with torch.no_grad():
        for ids in PROMPTS:
            a = a_model(torch.tensor([ids])).logits
            b = b_model(torch.tensor([ids])).logits
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_dequantize_load_computes_with_our_weights(checkpoint) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, out, loaded = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).eval()
    assert _max_rel_err(hf, _dense(model, loaded)) <= 1e-5  # measured 0.0


def test_default_load_runs_w8a8_with_its_own_rounding(checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    model, out, loaded = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    # Exactly compressed-tensors' rule on our weights (measured 0.0) ...
    assert _max_rel_err(hf, _dense(model, loaded, rule=_compressed_tensors_rule)) <= 1e-5
    # ... so the activations really are rounded (measured 7.6e-3 from the dense weights) ...
    assert _max_rel_err(hf, _dense(model, loaded)) > 1e-3
    # ... and quantkit's W8A8 is the same computation up to the two rules (measured 1.2e-2 on
    # this random model, whose logits are tiny).
    assert _max_rel_err(hf, _quantkit(model, loaded)) <= 0.05
