"""`quantkit quantize` / `inspect` end to end on a tiny model, and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli as run


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines, "expected an error line on stderr"
    last = lines[-1]
    assert last.startswith("error:") or last.startswith("interrupted"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in last, (n, last)


@pytest.fixture()
def calib_txt(tmp_path: Path) -> Path:
    from tests.conftest import _training_text

    path = tmp_path / "calib.txt"
    path.write_text("\n\n".join(_training_text() * 8))
    return path


def test_rtn_then_inspect(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    out = tmp_path / "ckpt"
    code, stdout, err = run(
        capsys,
        "quantize",
        str(tiny_model_dir),
        "--method",
        "rtn",
        "-o",
        str(out),
        "--eval-tokens",
        "600",
    )
    assert code == 0, err
    assert "rtn int4 g64 asymmetric (group size auto -> 64)" in stdout
    assert "perplexity" in stdout
    report = json.loads((out / "quantkit.json").read_text())["report"]
    assert report["perplexity"]["quantized"] > 1.0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    code, stdout, _ = run(capsys, "inspect", str(out))
    assert code == 0
    assert "weight_packed" in stdout and "int32" in stdout


def test_awq_with_calib_file(tmp_path: Path, tiny_model_dir: Path, calib_txt: Path, capsys) -> None:
    out = tmp_path / "awq"
    code, stdout, err = run(
        capsys,
        "quantize",
        str(tiny_model_dir),
        "--calib",
        str(calib_txt),
        "--calib-samples",
        "4",
        "--calib-seq-len",
        "64",
        "--search-tokens",
        "128",
        "--eval-tokens",
        "0",
        "-o",
        str(out),
        "--group-size",
        "32",
    )
    assert code == 0, err
    assert "layer-output MSE vs RTN" in stdout
    assert (out / "config.json").exists()


def test_missing_path(capsys) -> None:
    code, _, err = run(capsys, "quantize", "./no/such/model")
    _one_line_error(code, err, "does not exist")


def test_hub_id(capsys) -> None:
    code, _, err = run(capsys, "quantize", "meta-llama/Llama-3-8B")
    _one_line_error(code, err, "hub")


def test_bits_3(capsys, tiny_model_dir: Path) -> None:
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), "--bits", "3")
    _one_line_error(code, err, "bits", "got 3")


def test_group_size_not_dividing(tmp_path: Path, capsys) -> None:
    from tests.conftest import make_hf_model, make_tokenizer

    path = make_tokenizer(make_hf_model(tmp_path / "m", {"hidden_size": 96}))
    code, _, err = run(
        capsys,
        "quantize",
        str(path),
        "--group-size",
        "64",
        "--method",
        "rtn",
        "-o",
        str(tmp_path / "o"),
    )
    _one_line_error(code, err, "group_size 64 does not divide in_features 96", "q_proj")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content,needle", [("", "empty"), ("too short", "tokens")])
def test_bad_calib_file(tmp_path: Path, tiny_model_dir: Path, capsys, content, needle) -> None:
    calib = tmp_path / "c.txt"
    calib.write_text(content)
    code, _, err = run(
        capsys,
        "quantize",
        str(tiny_model_dir),
        "--calib",
        str(calib),
        "--eval-tokens",
        "0",
        "-o",
        str(tmp_path / "o"),
    )
    _one_line_error(code, err, needle)
    assert not (tmp_path / "o").exists()


def test_existing_output_without_force(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    out = tmp_path / "exists"
    out.mkdir()
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), "-o", str(out))
    _one_line_error(code, err, "exists", "--force")


def test_interrupt_leaves_nothing(
    tmp_path: Path, tiny_model_dir: Path, calib_txt: Path, capsys, monkeypatch
) -> None:
    import quantkit.quantize.awq

    calls = {"n": 0}
    real = quantkit.quantize.awq._search_clip

    def interrupt_midway(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # a few Linears into the first layer
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(quantkit.quantize.awq, "_search_clip", interrupt_midway)
    out = tmp_path / "ckpt"
    code, _, err = run(
        capsys,
        "quantize",
        str(tiny_model_dir),
        "--method",
        "awq",
        "--calib",
        str(calib_txt),
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "32",
        "--eval-tokens",
        "0",
        "-o",
        str(out),
    )
    assert code == 130
    _one_line_error(code, err, "interrupted")
    assert calls["n"] == 3
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]


@pytest.mark.parametrize(
    "extra,desc",
    [
        (["--method", "fp8"], "W8A16, rtn)"),
        (["--method", "rtn", "--activations", "dynamic"], "W8A8 dynamic per-token, rtn)"),
    ],
)
def test_fp8_quantize_and_run(tmp_path: Path, tiny_model_dir: Path, capsys, extra, desc) -> None:
    import torch

    from quantkit.runtime.loader import load_model
    from quantkit.runtime.quant_linear import QuantLinear

    out = tmp_path / "fp8"
    code, stdout, err = run(
        capsys,
        "quantize",
        str(tiny_model_dir),
        "--bits",
        "8",
        "-o",
        str(out),
        "--eval-tokens",
        "600",
        *extra,
    )
    assert code == 0, err
    assert f"fp8 e4m3 per-channel ({desc}" in stdout
    report = json.loads((out / "quantkit.json").read_text())["report"]
    ppl = report["perplexity"]
    # E4M3 keeps ~3 significant bits per weight with a per-channel scale: perplexity moves
    # by well under 5% even on a random tiny model.
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.05
    loaded = load_model(out)
    layer = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.float8_e4m3fn


def test_w8a8_perplexity_includes_activation_quantization(tiny_model_dir: Path) -> None:
    """The W8A8 report runs the real modules: its logits differ from the weight-only model's
    (the activations are rounded to fp8 per token only at run time)."""
    import torch

    from quantkit.format.scheme import QuantScheme
    from quantkit.models.decoder import build_model
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("fp8", activations="dynamic"))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        runtime = outcome.runtime_model()(ids)
        weight_only = build_model(outcome.config, outcome.dense_state())(ids)
    assert not torch.allclose(runtime, weight_only, rtol=1e-4, atol=1e-4)
    assert torch.allclose(runtime, weight_only, rtol=0.1, atol=0.1)  # and only rounding apart


def test_fp8_rejects_int4_only_options(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run(
        capsys,
        "quantize",
        str(tiny_model_dir),
        "--bits",
        "8",
        "--group-size",
        "64",
        "-o",
        str(tmp_path / "o"),
    )
    _one_line_error(code, err, "--group-size", "INT4-only", "--bits 8")
    args = ["--bits", "8", "--method", "fp8", "--calib-samples", "8", "-o", str(tmp_path / "o")]
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), *args)
    _one_line_error(code, err, "--calib-samples", "calibration option", "no calibration")
    code, _, err = run(capsys, "quantize", str(tiny_model_dir), "--bits", "8", "--method", "awq")
    _one_line_error(code, err, "method awq: produces int4 only", "rtn, gptq")
