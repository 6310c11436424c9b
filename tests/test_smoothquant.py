"""SmoothQuant on tiny random models, and `quantkit quantize --format int8` end to end.

- The fold is exact: smoothing alone leaves the float model's output unchanged (up to fp32
  rounding), GQA and not (v -> o joins the groups without it).
- With an outlier channel planted in the norms (what SmoothQuant is for), smoothing cuts every
  layer's W8A8 output error against plain rounding, and the checkpoint's modules compute what
  the walk left in the model.
- The CLI writes an `int-quantized` checkpoint that loads and generates (`--method smoothquant`;
  the default, SmoothQuant then GPTQ: test_smoothquant_gptq.py); every option that does not
  apply to int8 is a one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM, build_model
from quantkit.quantize.choice import choose_scheme
from quantkit.quantize.layer_walk import run_walk
from quantkit.quantize.smoothquant import (
    SmoothQuantConfig,
    smooth_model,
    smoothing_scale,
    smoothquant_walk,
    w8a8_activations,
)
from quantkit.runtime.quant_linear import QuantLinear
from tests.conftest import make_hf_model
from tests.conftest import run_cli as run

SCHEME = QuantScheme("int8")


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models gain nothing from a second thread, and a busy machine makes each OpenMP
    barrier a wait (`conftest.one_thread`)."""


def _load(path: Path) -> CausalLM:
    config = json.loads((path / "config.json").read_text())
    return build_model(config, load_file(path / "model.safetensors"))


def _samples(n: int = 8, t: int = 32, seed: int = 0) -> torch.Tensor:
    probs = 1.0 / torch.arange(1, 513, dtype=torch.float32)  # Zipf-like, as in real text
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, n * t, replacement=True, generator=gen).view(n, t)


def _plant_outliers(model: CausalLM, channels: tuple[int, ...] = (3, 17)) -> None:
    """A few hidden channels 40x louder into every Linear after a norm: LLM activations'
    outliers, which per-token int8 rounding handles badly."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[list(channels)] *= 40


def test_smoothing_scale() -> None:
    x = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smoothing_scale(x, w, 0.5)
    # sqrt(x / w); a channel that never fires or a zero weight column keeps 1.
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))
    assert torch.allclose(smoothing_scale(x[:2], w[:2], 1.0), x[:2])


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha-v-to-o"])
@pytest.mark.parametrize("linear_prev", [True, False])
def test_smoothing_leaves_the_float_model_unchanged(
    tmp_path: Path, kv_heads: int, linear_prev: bool
) -> None:
    model = _load(make_hf_model(tmp_path, {"num_key_value_heads": kv_heads}))
    _plant_outliers(model)
    ids = _samples(2, 24, seed=1)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    o_before = model.model.layers[1].self_attn.o_proj.weight.clone()
    with torch.no_grad():
        before = model(ids)
        smooth_model(model, _samples(), cfg=SmoothQuantConfig(linear_prev=linear_prev))
        after = model(ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # It did fold something: the norm, and o_proj's columns only when v -> o is a group.
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norm_before)
    moved = not torch.equal(model.model.layers[1].self_attn.o_proj.weight, o_before)
    assert moved == (kv_heads == 4 and linear_prev)


def test_smoothquant_cuts_the_w8a8_error_of_outlier_channels(tiny_llama_dir: Path) -> None:
    model = _load(tiny_llama_dir)
    _plant_outliers(model)
    walk = smoothquant_walk(model, _samples(), scheme=SCHEME, cfg=SmoothQuantConfig())
    weights, reports = run_walk(walk, model.model.layers)
    assert len(weights) == 2 * 7
    for r in reports:
        assert r.smoothed and r.method_error < 0.5 * r.rtn_error, r
    # The model now holds exactly the checkpoint's weights: its W8A8 forward is the runtime's.
    name = "model.layers.1.mlp.down_proj"
    tensors = weights[name]
    assert tensors["weight"].dtype == torch.int8 and tensors["weight_scale"].shape == (128, 1)
    layer = model.model.layers[1]
    linear = QuantLinear.from_tensors(tensors, scheme=SCHEME)
    x = torch.randn(5, 256)
    with w8a8_activations(layer, ("mlp.down_proj",)):
        emulated = layer.mlp.down_proj(x)
    torch.testing.assert_close(linear(x), emulated, rtol=1e-5, atol=1e-5)


def test_int8_is_named_by_format_and_defaults_to_smoothquant_gptq() -> None:
    base = dict(method=None, activations="none", group_size="auto", symmetric=False)
    scheme, algorithm = choose_scheme(bits=8, fmt="int8", given={"bits", "fmt"}, **base)
    assert (scheme, algorithm) == (SCHEME, "smoothquant+gptq")
    scheme, algorithm = choose_scheme(bits=8, fmt=None, given={"bits"}, **base)
    assert (scheme.kind, algorithm) == ("fp8", "gptq")


def _one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code != 0 and lines and lines[-1].startswith("error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--group-size", "64"], ["--group-size", "INT4-only", "--format int8"]),
        (["--symmetric"], ["--symmetric", "INT4-only"]),
        (["--method", "awq"], ["method awq", "int4 only", "rtn, gptq, smoothquant"]),
        (["--method", "awq+gptq"], ["method awq+gptq", "for int8 expected one of rtn, gptq"]),
        (["--activations", "none"], ["--format int8 means --activations dynamic"]),
        (["--bits", "4"], ["--format int8 means --bits 8, got --bits 4"]),
        (["--method", "fp8"], ["--method fp8 means --bits 8 --method rtn, got --format int8"]),
        (["--method", "smoothquant", "--damp", "0.1"], ["--damp", "GPTQ-only"]),
        (["--method", "rtn", "--calib-samples", "4"], ["--calib-samples", "no calibration"]),
    ],
)
def test_options_that_do_not_apply_to_int8(
    tiny_model_dir: Path, tmp_path: Path, capsys, args: list[str], needles: list[str]
) -> None:
    out = tmp_path / "o"
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), "--format", "int8", *args)
    _one_line_error(code, err, *needles)
    assert not out.exists()


@pytest.mark.parametrize("bits", ["4", "8"])
def test_smoothquant_needs_int8(tiny_model_dir: Path, capsys, bits: str) -> None:
    code, _, err = run(
        capsys, "quantize", str(tiny_model_dir), "--bits", bits, "--method", "smoothquant"
    )
    _one_line_error(code, err, "method smoothquant", "int8 only")


def test_quantize_int8_then_load_and_generate(tmp_path: Path, tiny_model_dir: Path, capsys):
    from tests.conftest import _training_text

    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(_training_text() * 8))
    out = tmp_path / "int8"
    code, stdout, err = run(
        capsys, "quantize", str(tiny_model_dir), "--format", "int8", "--method", "smoothquant",
        "--calib", str(calib),
        "--calib-samples", "4", "--calib-seq-len", "32", "--eval-tokens", "600", "-o", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert "int8 per-channel (W8A8 dynamic per-token, smoothquant)" in stdout
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["algorithm"] == "smoothquant"
    ppl = meta["report"]["perplexity"]
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.05
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized"
    assert cfg["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"

    from quantkit.runtime.loader import load_model

    loaded = load_model(out)
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.int8
    code, stdout, err = run(
        capsys, "generate", str(out), "--prompt", "Beautiful is", "--max-new-tokens", "6",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(stdout)
    assert result["generated_tokens"] >= 1
