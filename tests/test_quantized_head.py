"""`--quantize-head`: the lm_head stored in the checkpoint's format as its own Linear.

The embedding stays dense (a lookup table) and is untied; config.json's `ignore` no longer
names lm_head, so compressed-tensors readers build it quantized. quantkit's run of the
checkpoint and transformers' dequantized load must agree, and the head must really be
quantized (fewer bytes, a nonzero but bounded error).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.format.scheme import QuantScheme
from quantkit.perf.roofline import model_read_bytes
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.loader import load_model
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.quant_linear import QuantLinear

PROMPTS = [[1, 5, 9, 200, 37, 11], [1, 300, 42, 7]]
SCHEMES = {"int4-g32": QuantScheme("int4", 32), "fp8": QuantScheme("fp8")}


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


def _logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("name", SCHEMES)
def test_quantized_head_round_trips_through_quantkit_and_transformers(
    name: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    plain = quantize_model(tiny_llama_dir, scheme=SCHEMES[name])
    headed = quantize_model(tiny_llama_dir, scheme=SCHEMES[name], quantize_head=True)
    assert "lm_head" in headed.quantized_modules
    # No dense head left: INT4 stores weight_packed; FP8's `weight` is the float8 codes.
    assert headed.tensors.get(
        "lm_head.weight", torch.empty(0, dtype=torch.float8_e4m3fn)
    ).dtype in (torch.float8_e4m3fn,)
    # A tied head was free on disk (it is the embedding); quantized, it is its own copy, small.
    head = plain.tensors["model.embed_tokens.weight"]
    extra = headed.bytes_after - plain.bytes_after
    assert 0 < extra < head.numel() * head.element_size() / 3
    out = headed.save(tmp_path / "ckpt", source_dir=tiny_llama_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["ignore"] == []

    ours = load_model(out, tokenizer=False, options=RuntimeOptions.cli(dtype="float32")).model
    assert isinstance(ours.lm_head, QuantLinear)
    # Every decode step reads far fewer head bytes than the dense fp32 head it replaces.
    dense_run = load_model(tiny_llama_dir, tokenizer=False).model
    assert model_read_bytes(ours).head < model_read_bytes(dense_run).head / 3

    hf = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).eval()
    for ids in PROMPTS:
        a, b = _logits(ours, ids), _logits(hf, ids)
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-3
    # The head is really quantized: the logits move against the dense-head checkpoint.
    plain_model = plain.runtime_model()
    moved = max(
        ((_logits(ours, ids) - _logits(plain_model, ids)).abs().max()).item() for ids in PROMPTS
    )
    assert moved > 1e-5


def test_quantized_head_needs_a_group_size_that_divides_the_hidden_size(
    tiny_llama_dir: Path,
) -> None:
    from quantkit.errors import SchemeError

    # hidden 128: 128 divides it, and the layers; the head's input is the same hidden size.
    outcome = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", 128), quantize_head=True)
    assert outcome.tensors["lm_head.weight_scale"].shape[1] == 1
    with pytest.raises(SchemeError):
        quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", 96), quantize_head=True)


def test_a_quantized_head_refuses_another_head_dtype(tiny_llama_dir: Path, tmp_path: Path):
    from quantkit.errors import GenerationError

    out = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", 32), quantize_head=True).save(
        tmp_path / "ckpt", source_dir=tiny_llama_dir
    )
    auto = load_model(out, tokenizer=False, options=RuntimeOptions.cli()).model
    assert isinstance(auto.lm_head, QuantLinear)  # auto leaves a quantized head alone
    with pytest.raises(GenerationError, match="lm_head is quantized"):
        load_model(out, tokenizer=False, options=RuntimeOptions.cli(head_dtype="bfloat16"))


def test_generate_names_a_quantized_head(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    from tests.conftest import run_cli

    out = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", 32), quantize_head=True).save(
        tmp_path / "ckpt", source_dir=tiny_model_dir
    )
    code, stdout, err = run_cli(
        capsys, "generate", str(out), "--prompt", "hi", "--max-new-tokens", "2"
    )
    assert code == 0, err
    assert "lm_head int4 g32 asymmetric" in stdout + err
