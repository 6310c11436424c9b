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
from quantkit.format.packing import FP8_MAX, dequantize_packed_int4, fp8_codes, fp8_row_scale
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import check_module_tensors
from quantkit.models.decoder import build_model
from quantkit.quantize.algorithms import algorithm_for
from quantkit.quantize.gptq import (
    GptqConfig,
    Hessian,
    gptq_fp8,
    gptq_quantize,
    gptq_round,
    gptq_weight,
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


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme("fp8"), QuantScheme("int4", 32), QuantScheme("int4", -1, True)],
    ids=["fp8", "int4-g32", "int4-channel-sym"],
)
@pytest.mark.parametrize("sequential", [True, False])
def test_layer_by_layer_on_tiny_model(
    tiny_llama_dir: Path, sequential: bool, scheme: QuantScheme
) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    model = build_model(config, load_file(tiny_llama_dir / "model.safetensors"))
    seen: list[int] = []
    cfg = GptqConfig(sequential=sequential, batch_sequences=4)
    weights, reports = gptq_quantize(
        model,
        _samples(),
        scheme=scheme,
        cfg=cfg,
        on_layer=lambda r: seen.append(r.index),
    )
    assert len(weights) == 2 * 7 and seen == [0, 1]
    for r in reports:
        assert r.method_error < r.rtn_error and 0 < r.loss_reduction < 1, r
    local = weights["model.layers.1.self_attn.k_proj"]
    check_module_tensors(local, scheme=scheme)
    # The model now computes with exactly the stored weights.
    if scheme.kind == "fp8":
        stored = local["weight"].float() * local["weight_scale"].float()
    else:
        stored = dequantize_packed_int4(
            local["weight_packed"],
            local["weight_scale"],
            local.get("weight_zero_point"),
            in_features=128,
            group_size=scheme.group_size_for(128),
        )
    assert stored.shape == (64, 128)
    torch.testing.assert_close(
        model.model.layers[1].self_attn.k_proj.weight, stored, rtol=0, atol=0
    )


def test_int4_rounding_keeps_each_column_in_its_group() -> None:
    """act-order permutes columns; a column must still round on its own group's scale."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen) * torch.linspace(0.1, 3.0, 64)
    x = _correlated_inputs(512, 64)
    scheme = QuantScheme("int4", 32)
    plain, _ = gptq_weight(w, _hessian(x), scheme=scheme)
    ordered, rounder = gptq_weight(w, _hessian(x), scheme=scheme, cfg=GptqConfig(act_order=True))
    for q in (plain, ordered):
        # Every value is a code of its own group: re-quantizing on the fixed scales is exact.
        torch.testing.assert_close(rounder.stored(q), q, rtol=0, atol=1e-6)
    h = _hessian(x)
    assert output_error(w, ordered, h) < output_error(w, rounder.nearest(w), h)


def test_gptq_is_an_algorithm_not_a_format() -> None:
    s = QuantScheme("fp8", activations="dynamic")
    assert s.describe("gptq") == "fp8 e4m3 per-channel (W8A8 dynamic per-token, gptq)"
    assert QuantScheme("int4", 64).describe("gptq") == "gptq int4 g64 asymmetric"
    # The config round-trips the format alone: whichever algorithm chose the codes.
    for scheme in (s, QuantScheme("int4", 32)):
        assert scheme_from_quantization_config(scheme_to_quantization_config(scheme)) == scheme
    kinds = ("int4", "fp8", "int8", "nvfp4", "mxfp4")
    assert algorithm_for("gptq", QuantScheme("int4")).kinds == kinds
    assert algorithm_for(None, QuantScheme("fp8")).name == "gptq"
    assert algorithm_for(None, QuantScheme("int4")).name == "awq+gptq"
    with pytest.raises(
        SchemeError, match="method awq: produces int4 only; for fp8 expected one of rtn, gptq"
    ):
        algorithm_for("awq", QuantScheme("fp8"))
    with pytest.raises(SchemeError, match=r"method: expected one of rtn, awq, gptq, .*got 'sq'"):
        algorithm_for("sq", QuantScheme("int4"))


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
    assert f"fp8 e4m3 per-channel ({desc}" in stdout and ", gptq)" in stdout
    assert "Linear-output error vs RTN" in stdout and "calibration" in stdout
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["algorithm"] == "gptq" and meta["scheme"]["kind"] == "fp8"
    report = meta["report"]
    assert report["calibration"]["samples"] == 4
    assert report["gptq"]["damp"] == 0.01 and len(report["gptq_layer_error_reduction"]) == 2
    ppl = report["perplexity"]
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.05
    # The same float-quantized checkpoint as round to nearest: only the codes differ.
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "float-quantized"
    assert load_checkpoint(out).algorithm == "gptq"
    loaded = load_model(out)
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[1, 5, 9, 3]]))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "v1_scheme,scheme,algorithm",
    [
        # as written before `rounding` existed, with it, and an int4 one
        ({"method": "fp8", "bits": 8}, QuantScheme("fp8"), "rtn"),
        ({"method": "fp8", "bits": 8, "rounding": "gptq"}, QuantScheme("fp8"), "gptq"),
        ({"method": "fp8", "bits": 8, "rounding": "nearest"}, QuantScheme("fp8"), "rtn"),
    ],
)
def test_version_1_metadata_reads_as_format_plus_algorithm(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys,
    v1_scheme: dict,
    scheme: QuantScheme,
    algorithm: str,
) -> None:
    from quantkit.format.checkpoint import load_checkpoint

    out = tmp_path / "fp8"
    args = ["--bits", "8", "--method", "fp8", "-o", str(out), "--eval-tokens", "0"]
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), *args)
    assert code == 0, err
    meta_path = out / "quantkit.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format_version"] == 2 and meta["algorithm"] == "rtn"
    meta["format_version"] = 1
    meta["scheme"] = {"group_size": -1, "symmetric": True, "activations": "none", **v1_scheme}
    del meta["algorithm"]
    meta_path.write_text(json.dumps(meta))
    loaded = load_checkpoint(out)
    assert (loaded.scheme, loaded.algorithm) == (scheme, algorithm)
    meta["scheme"]["method"] = "awq"  # int4 provenance on float weights: a hand edit
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="expected scheme"):
        load_checkpoint(out)


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--method", "awq", "--bits", "8"], ["method awq", "int4 only", "rtn, gptq"]),
        (["--method", "fp8", "--bits", "4"], ["--method fp8 means --bits 8 --method rtn"]),
        (["--bits", "8", "--method", "gptq", "--group-size", "64"], ["--group-size", "INT4-only"]),
        (["--bits", "8", "--method", "fp8", "--damp", "0.1"], ["--damp", "GPTQ-only", "gptq"]),
        (["--method", "rtn", "--act-order"], ["--act-order", "GPTQ-only"]),
        (["--method", "awq", "--damp", "0.1"], ["--damp", "GPTQ-only"]),
        (["--method", "gptq", "--search-tokens", "64"], ["--search-tokens", "AWQ-only"]),
        (["--method", "rtn", "--calib-samples", "4"], ["--calib-samples", "no calibration"]),
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
    loaded = load_checkpoint(out)
    assert (loaded.scheme, loaded.algorithm) == (QuantScheme("fp8"), "gptq")


def test_cli_gptq_int4_round_trip(
    tmp_path: Path, tiny_model_dir: Path, calib_txt: Path, capsys
) -> None:
    """GPTQ for INT4 is one registry entry: same pack-quantized checkpoint as AWQ and RTN."""
    from quantkit.format.checkpoint import load_checkpoint
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.quant_linear import QuantLinear

    out = tmp_path / "gptq4"
    args = ["quantize", str(tiny_model_dir), "--method", "gptq", "--group-size", "32"]
    calib = ["--calib", str(calib_txt), "--calib-samples", "4", "--calib-seq-len", "64"]
    code, stdout, err = run(capsys, *args, *calib, "--eval-tokens", "600", "-o", str(out))
    assert code == 0, err
    assert "gptq int4 g32 asymmetric" in stdout and "Linear-output error vs RTN" in stdout
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["algorithm"] == "gptq" and meta["scheme"]["kind"] == "int4"
    assert len(meta["report"]["gptq_layer_error_reduction"]) == 2
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "pack-quantized"
    ppl = meta["report"]["perplexity"]
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.2
    loaded = load_checkpoint(out)
    assert (loaded.scheme, loaded.algorithm) == (QuantScheme("int4", 32), "gptq")
    layer = load_model(out).model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.weight_packed.dtype == torch.int32
