"""GPTQ rounding for FP8: the math on single Linears, the layer-by-layer driver on a tiny model,
the scheme and checkpoint round trip, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.compressed_tensors import (
    scheme_from_quantization_config,
    scheme_to_quantization_config,
)
from quantkit.format.packing import FP8_MAX, fp8_codes, fp8_row_scale
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import build_model
from quantkit.models.families import arch_for
from quantkit.quantize.gptq import (
    GptqConfig,
    Hessian,
    gptq_fp8,
    gptq_quantize_fp8,
    gptq_round,
    output_error,
)
from tests.conftest import run_cli as run
from tests.test_cli_quantize import _one_line_error


def _correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with mixed channels and uneven channel scales, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    return torch.randn(tokens, k, generator=g) @ mix * (3 * torch.rand(k, generator=g) + 0.1)


def _weight(n: int, k: int, seed: int = 1) -> torch.Tensor:
    return 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _hessian(x: torch.Tensor) -> torch.Tensor:
    h = Hessian(x.shape[1])
    for part in x.split(1000):
        h.add(part)
    return h.matrix()


def _rtn(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8_codes(w, scale).float() * scale


def test_hessian_is_two_xtx_over_tokens() -> None:
    x = _correlated_inputs(300, 24)
    want = (2 * x.double().T @ x.double()) / 300
    # Chunks are multiplied in fp32 (summed in fp64): fp32 accuracy relative to the diagonal.
    torch.testing.assert_close(_hessian(x), want, rtol=1e-5, atol=1e-5 * float(want.max()))
    with pytest.raises(ValueError, match="at least one calibration token"):
        Hessian(4).matrix()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n,k,block", [(64, 96, 128), (33, 200, 64)])
def test_gptq_output_error_below_rtn(n: int, k: int, block: int, act_order: bool) -> None:
    x = _correlated_inputs(2048, k)
    w = _weight(n, k)
    cfg = GptqConfig(block_size=block, act_order=act_order)
    codes, scale = gptq_fp8(w, _hessian(x), cfg=cfg)
    err_gptq = (x @ (w - codes.float() * scale).T).pow(2).sum()
    err_rtn = (x @ (w - _rtn(w, scale)).T).pow(2).sum()
    # Measured 0.4-0.6x on these shapes; strictly lower with a margin, not a coin flip.
    assert err_gptq < 0.8 * err_rtn, (float(err_gptq), float(err_rtn))


def test_codes_are_e4m3_on_the_stored_scale_grid() -> None:
    x = _correlated_inputs(1024, 80)
    w = _weight(40, 80)
    w[3, 7] = 2.0  # one outlier row: its scale is set by this weight
    codes, scale = gptq_fp8(w, _hessian(x), scale_dtype=torch.bfloat16)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    values = codes.float()
    assert torch.isfinite(values).all() and values.abs().max() <= FP8_MAX
    # The scale is RTN's, as bf16 stores it, fixed before rounding.
    torch.testing.assert_close(scale, fp8_row_scale(w).to(torch.bfloat16).float(), rtol=0, atol=0)
    assert scale.shape == (40, 1)
    # Every value is one E4M3 code: casting again changes nothing.
    assert torch.equal(values.to(torch.float8_e4m3fn).float(), values)


def test_diagonal_hessian_is_round_to_nearest() -> None:
    # Uncorrelated inputs: nothing to compensate through, so GPTQ is RTN code for code.
    w = _weight(48, 64)
    h = torch.diag(torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5)
    codes, scale = gptq_fp8(w, h, cfg=GptqConfig(damp=0.0))
    assert torch.equal(codes.float(), fp8_codes(w, scale).float())


def test_uncorrelated_samples_stay_close_to_rtn() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20000, 64, generator=g)
    w = _weight(48, 64)
    h = _hessian(x)
    codes, scale = gptq_fp8(w, h)
    agree = (codes.float() == fp8_codes(w, scale).float()).float().mean()
    ratio = output_error(w, codes.float() * scale, h) / output_error(w, _rtn(w, scale), h)
    assert agree > 0.9 and 0.9 < ratio <= 1.0, (float(agree), ratio)


def test_block_size_does_not_change_the_result() -> None:
    # The lazy batch update is algebra, not an approximation: only float rounding differs.
    x = _correlated_inputs(1024, 70)
    w, h = _weight(20, 70), _hessian(x)
    scale = fp8_row_scale(w)
    qs = [
        gptq_round(w, h, round_fn=lambda c, _i: _rtn(c, scale), block_size=b) for b in (1, 16, 70)
    ]
    for q in qs[1:]:
        assert (q == qs[0]).float().mean() > 0.99


def test_dead_input_channels_get_zero_weight() -> None:
    x = _correlated_inputs(512, 32)
    x[:, 5] = 0.0
    w = _weight(16, 32)
    codes, scale = gptq_fp8(w, _hessian(x))
    assert torch.all(codes.float()[:, 5] == 0)
    assert torch.isfinite(codes.float()).all()


def test_round_fn_sees_original_column_indices_under_act_order() -> None:
    x = _correlated_inputs(512, 16)
    seen: list[int] = []

    def record(columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        seen.extend(index.tolist())
        return columns.round()

    gptq_round(_weight(4, 16), _hessian(x), round_fn=record, act_order=True)
    assert sorted(seen) == list(range(16)) and seen != list(range(16))


def test_bad_shapes_and_options() -> None:
    with pytest.raises(ValueError, match=r"expected \[8, 8\]"):
        gptq_round(torch.zeros(4, 8), torch.eye(6), round_fn=lambda c, _i: c)
    with pytest.raises(ValueError, match="block_size >= 1"):
        gptq_round(torch.zeros(4, 8), torch.eye(8), round_fn=lambda c, _i: c, block_size=0)


def _samples(n: int = 6, t: int = 32) -> torch.Tensor:
    probs = 1.0 / torch.arange(1, 513, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    return torch.multinomial(probs, n * t, replacement=True, generator=gen).view(n, t)


@pytest.mark.parametrize("sequential", [True, False])
def test_layer_by_layer_on_tiny_model(tiny_llama_dir: Path, sequential: bool) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    model = build_model(config, load_file(tiny_llama_dir / "model.safetensors"))
    seen: list[int] = []
    cfg = GptqConfig(sequential=sequential, batch_sequences=4)
    weights, reports = gptq_quantize_fp8(
        model, _samples(), arch=arch_for(config), cfg=cfg, on_layer=lambda r: seen.append(r.index)
    )
    assert len(weights) == 2 * 7 and seen == [0, 1]
    for r in reports:
        assert r.method_error < r.rtn_error and 0 < r.loss_reduction < 1, r
    codes, scale = weights["model.layers.1.self_attn.k_proj"]
    assert codes.shape == (64, 128) and scale.shape == (64, 1)
    # The model now computes with exactly the stored FP8 weights.
    torch.testing.assert_close(
        model.model.layers[1].self_attn.k_proj.weight, codes.float() * scale, rtol=0, atol=0
    )


def test_scheme_rounding() -> None:
    s = QuantScheme("fp8", 8, activations="dynamic", rounding="gptq")
    assert s.describe() == "fp8 e4m3 per-channel (W8A8 dynamic per-token, GPTQ rounding)"
    # Same compressed-tensors config as round to nearest: only the codes differ.
    assert scheme_to_quantization_config(s) == scheme_to_quantization_config(
        QuantScheme("fp8", 8, activations="dynamic")
    )
    with pytest.raises(SchemeError, match="gptq is implemented for fp8"):
        QuantScheme("awq", 4, rounding="gptq")
    with pytest.raises(SchemeError, match="rounding: expected one of nearest, gptq"):
        QuantScheme("fp8", 8, rounding="stochastic")  # type: ignore[arg-type]
    qcfg = scheme_to_quantization_config(QuantScheme("rtn", 4, 32))
    with pytest.raises(CheckpointError, match="expected 'nearest' for int4"):
        scheme_from_quantization_config(qcfg, method="rtn", rounding="gptq")
    with pytest.raises(CheckpointError, match="scheme.rounding"):
        scheme_from_quantization_config(qcfg, rounding="bogus")


@pytest.fixture()
def calib_txt(tmp_path: Path) -> Path:
    from tests.conftest import _training_text

    path = tmp_path / "calib.txt"
    path.write_text("\n\n".join(_training_text() * 8))
    return path


@pytest.mark.parametrize("extra,desc", [([], "W8A16"), (["--activations", "dynamic"], "W8A8")])
def test_cli_gptq_round_trip(
    tmp_path: Path, tiny_model_dir: Path, calib_txt: Path, capsys, extra: list[str], desc: str
) -> None:
    from quantkit.format.checkpoint import load_checkpoint
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.quant_linear import QuantLinear

    out = tmp_path / "gptq"
    args = ["quantize", str(tiny_model_dir), "--bits", "8", "--method", "gptq", "-o", str(out)]
    calib = ["--calib", str(calib_txt), "--calib-samples", "4", "--calib-seq-len", "64"]
    code, stdout, err = run(capsys, *args, *calib, "--eval-tokens", "600", *extra)
    assert code == 0, err
    assert f"fp8 e4m3 per-channel ({desc}" in stdout and "GPTQ rounding)" in stdout
    assert "Linear-output error vs RTN" in stdout and "calibration" in stdout
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["scheme"]["rounding"] == "gptq" and meta["scheme"]["method"] == "fp8"
    report = meta["report"]
    assert report["calibration"]["samples"] == 4
    assert report["gptq"]["damp"] == 0.01 and len(report["gptq_layer_error_reduction"]) == 2
    ppl = report["perplexity"]
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.05
    # The same float-quantized checkpoint as round to nearest: only the codes differ.
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "float-quantized"
    assert load_checkpoint(out).scheme.rounding == "gptq"
    loaded = load_model(out)
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[1, 5, 9, 3]]))
    assert torch.isfinite(logits).all()


def test_checkpoint_without_rounding_field_reads_as_nearest(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    from quantkit.format.checkpoint import load_checkpoint

    out = tmp_path / "fp8"
    args = ["--bits", "8", "--method", "fp8", "-o", str(out), "--eval-tokens", "0"]
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), *args)
    assert code == 0, err
    meta_path = out / "quantkit.json"
    meta = json.loads(meta_path.read_text())
    del meta["scheme"]["rounding"]  # as written before the field existed
    meta_path.write_text(json.dumps(meta))
    assert load_checkpoint(out).scheme == QuantScheme("fp8", 8)


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--method", "gptq"], ["--method gptq", "expected --bits 8", "got --bits 4"]),
        (["--method", "gptq", "--bits", "4"], ["fp8 only", "got --bits 4"]),
        (["--bits", "8", "--method", "gptq", "--group-size", "64"], ["--group-size", "INT4-only"]),
        (["--bits", "8", "--method", "fp8", "--damp", "0.1"], ["--damp", "GPTQ-only", "fp8"]),
        (["--method", "rtn", "--act-order"], ["--act-order", "GPTQ-only"]),
        (["--bits", "8", "--method", "gptq", "--damp", "-1"], ["--damp", "got -1"]),
    ],
)
def test_cli_gptq_errors(
    tiny_model_dir: Path, tmp_path: Path, capsys, args: list[str], needles: list[str]
) -> None:
    out = tmp_path / "o"
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), *args, "-o", str(out))
    _one_line_error(code, err, *needles)
    assert not out.exists()


def test_cli_bits_8_defaults_to_gptq_on_128_windows(
    tmp_path: Path, tiny_model_dir: Path, calib_txt: Path, capsys
) -> None:
    from quantkit.format.checkpoint import load_checkpoint

    out = tmp_path / "gptq"
    args = ["--bits", "8", "--calib", str(calib_txt), "--calib-seq-len", "16"]
    code, _, err = run(
        capsys, "quantize", str(tiny_model_dir), *args, "--eval-tokens", "0", "-o", str(out)
    )
    assert code == 0, err
    report = json.loads((out / "quantkit.json").read_text())["report"]
    assert report["calibration"]["samples"] == 128 and report["gptq"]["act_order"] is True
    assert load_checkpoint(out).scheme == QuantScheme("fp8", 8, rounding="gptq")
