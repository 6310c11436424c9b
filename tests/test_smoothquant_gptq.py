"""GPTQ on INT8 W8A8 (`gptq` on int8, and `smoothquant+gptq`) on tiny random models.

- `Int8Rounder` rounds on RTN's per-row scale as stored, and GPTQ on it lowers a Linear's output
  error against round to nearest.
- SmoothQuant then GPTQ cuts every layer's W8A8 output error at least as far as SmoothQuant
  with round to nearest, and the model is left holding exactly the checkpoint's weights.
- `--format int8` defaults to it, and writes the same `int-quantized` checkpoint as before,
  which the loader runs; GPTQ's options are taken, and the combinations that do not apply are
  one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.format.compressed_tensors import scheme_to_quantization_config
from quantkit.format.packing import int8_row_scale
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.choice import choose_scheme
from quantkit.quantize.gptq import Hessian, gptq_weight, output_error
from quantkit.quantize.gptq_rows import Int8Rounder
from quantkit.quantize.layer_walk import run_walk
from quantkit.quantize.smoothquant import SmoothQuantConfig, smoothquant_walk, w8a8_activations
from quantkit.quantize.smoothquant_gptq import smoothquant_gptq_walk
from quantkit.runtime.quant_linear import QuantLinear
from tests.conftest import run_cli as run
from tests.test_smoothquant import _load, _one_line_error, _plant_outliers, _samples

SCHEME = QuantScheme("int8")


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models gain nothing from a second thread (`conftest.one_thread`)."""


def _correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated channels and a few loud ones, as a Linear's real inputs are."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5
    x = torch.randn(tokens, k, generator=gen) @ mix
    x[:, :3] *= 8
    return x


def test_int8_rounder_is_rtn_on_the_stored_scale() -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 40)
    rounder = Int8Rounder(w, SCHEME, scale_dtype=torch.bfloat16)
    assert torch.equal(rounder.scale, int8_row_scale(w).to(torch.bfloat16).float())
    nearest = rounder.nearest(w)
    tensors = rounder.tensors(nearest, slice(0, 24), dtype=torch.bfloat16)
    assert tensors["weight"].dtype == torch.int8 and tensors["weight_scale"].shape == (24, 1)
    # What the checkpoint stores computes with exactly the values GPTQ saw.
    dense = SCHEME.format.dequantize(tensors, SCHEME, dtype=torch.float32)
    assert torch.equal(dense, rounder.stored(nearest))
    assert torch.equal(rounder.stored(nearest), nearest)


def test_gptq_lowers_the_int8_output_error() -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 64) * 0.05
    h = Hessian(64)
    h.add(_correlated_inputs(2048, 64))
    matrix = h.matrix()
    q, rounder = gptq_weight(w, matrix, scheme=SCHEME, scale_dtype=torch.bfloat16)
    stored = rounder.stored(q)
    gptq, rtn = output_error(w, stored, matrix), output_error(w, rounder.nearest(w), matrix)
    assert gptq < 0.7 * rtn, (gptq, rtn)
    assert rounder.codes(q).abs().max() <= 127


@pytest.mark.parametrize("runtime_inputs", [True, False])
def test_smoothquant_gptq_beats_smoothquant_per_layer(
    tiny_llama_dir: Path, runtime_inputs: bool
) -> None:
    errors = {}
    for name in ("smoothquant", "smoothquant+gptq"):
        model = _load(tiny_llama_dir)
        _plant_outliers(model)
        cfg = SmoothQuantConfig(runtime_inputs=runtime_inputs)
        if name == "smoothquant":
            walk = smoothquant_walk(model, _samples(16, 64), scheme=SCHEME, cfg=cfg)
        else:
            walk = smoothquant_gptq_walk(model, _samples(16, 64), scheme=SCHEME, smoothquant=cfg)
        weights, reports = run_walk(walk, model.model.layers)
        errors[name] = [r.method_error for r in reports]
        assert all(r.method_error < r.rtn_error for r in reports), reports
    for sq, sq_gptq in zip(errors["smoothquant"], errors["smoothquant+gptq"], strict=True):
        assert sq_gptq < sq, errors
    # The model holds exactly the checkpoint's weights.
    layer = model.model.layers[1]
    linear = QuantLinear.from_tensors(weights["model.layers.1.self_attn.o_proj"], scheme=SCHEME)
    x = torch.randn(5, layer.self_attn.o_proj.in_features)
    with w8a8_activations(layer, ("self_attn.o_proj",)):
        emulated = layer.self_attn.o_proj(x)
    torch.testing.assert_close(linear(x), emulated, rtol=1e-5, atol=1e-5)


def test_gptq_and_smoothquant_gptq_are_int8_methods() -> None:
    base = dict(activations="none", group_size="auto", symmetric=False)
    for method in ("gptq", "smoothquant+gptq"):
        given = {"fmt", "method", "damp"}
        scheme, algorithm = choose_scheme(bits=8, fmt="int8", method=method, given=given, **base)
        assert (scheme, algorithm) == (SCHEME, method)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--bits", "4"], ["method smoothquant+gptq", "int8 only", "for int4 expected one of"]),
        (["--bits", "8"], ["method smoothquant+gptq", "int8 only", "for fp8 expected one of"]),
        (["--format", "int8", "--clip", "mse"], ["--clip", "INT4-only"]),
        (["--format", "int8", "--search-tokens", "9"], ["--search-tokens", "AWQ-only"]),
    ],
)
def test_combinations_that_do_not_apply(
    tiny_model_dir: Path, capsys, args: list[str], needles: list[str]
) -> None:
    code, _, err = run(
        capsys, "quantize", str(tiny_model_dir), "--method", "smoothquant+gptq", *args
    )
    _one_line_error(code, err, *needles)


def test_quantize_int8_defaults_to_smoothquant_gptq_then_load(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    from tests.conftest import _training_text

    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(_training_text() * 8))
    out = tmp_path / "int8"
    code, stdout, err = run(
        capsys, "quantize", str(tiny_model_dir), "--format", "int8", "--damp", "0.02",
        "--calib", str(calib), "--calib-samples", "4", "--calib-seq-len", "32",
        "--eval-tokens", "600", "-o", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert "int8 per-channel (W8A8 dynamic per-token, smoothquant+gptq)" in stdout
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["algorithm"] == "smoothquant+gptq"
    assert meta["report"]["gptq"]["damp"] == 0.02
    ppl = meta["report"]["perplexity"]
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.05
    # The same compressed-tensors W8A8 entry as every int8 checkpoint: the format alone.
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == scheme_to_quantization_config(SCHEME)
    assert cfg["format"] == "int-quantized"

    from quantkit.runtime.loader import load_model

    loaded = load_model(out)
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.int8
