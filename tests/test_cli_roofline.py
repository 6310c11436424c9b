"""`quantkit roofline`: built-in shapes, model directories, this machine, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from quantkit.perf.planning import KNOWN_MODELS, resolve_shape
from quantkit.perf.roofline import ModelShape
from tests.conftest import run_cli as run


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


def _row(text: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)} +(.+)$", text, re.MULTILINE)
    assert match, (label, text)
    return match.group(1)


def test_article_numbers_for_llama_31_8b_on_an_a100(capsys) -> None:
    code, out, err = run(
        capsys, "roofline", "Llama-3.1-8B", "--gpu", "A100-SXM4-80GB", "--context", "8192",
        "--users", "60",
    )  # fmt: skip
    assert code == 0, err
    assert _row(out, "KV cache per token") == "128.0 KiB"
    assert _row(out, "concurrent users at 8192 tokens") == "61"
    assert _row(out, "KV for 60 user(s) x 8192 tokens").endswith("fits")
    assert "1.00 FLOP/byte: memory-bound (ridge 153)" in out


def test_int4_on_a_4090_from_a_model_directory(tiny_model_dir: Path, capsys) -> None:
    code, out, err = run(capsys, "roofline", str(tiny_model_dir), "--gpu", "4090", "--bits", "4")
    assert code == 0, err
    # The tiny model's Linears have in_features 64 and 256: auto picks g64, as the quantizer.
    assert f"roofline: {tiny_model_dir.name}" in out and "(INT4 g64)" in out
    code, same, _ = run(
        capsys, "roofline", str(tiny_model_dir / "config.json"), "--gpu", "4090", "--bits", "4"
    )
    assert code == 0 and same.splitlines()[1:] == out.splitlines()[1:]


def test_this_machine_when_no_gpu_is_named(capsys) -> None:
    code, out, err = run(capsys, "roofline", "smollm2-135m", "--bits", "4", "--context", "512")
    assert code == 0, err
    assert "copy probe v2 on" in _row(out, "hardware")
    # fp32 on a CPU: the tied 49152 x 576 head is 113 MB, more than the whole INT4 body.
    assert _row(out, "  lm_head (tied)").startswith("0.113 GB")
    assert "(INT4 g64)" in out


def test_known_shapes_match_their_published_sizes() -> None:
    billions = {
        "llama-3.2-1b": 1.236, "llama-3.2-3b": 3.213, "llama-3.1-8b": 8.030,
        "llama-3.1-70b": 70.554, "llama-2-7b": 6.738, "llama-2-13b": 13.016,
        "mistral-7b": 7.242, "qwen2.5-7b": 7.616, "smollm2-135m": 0.1345,
    }  # fmt: skip
    assert set(billions) == set(KNOWN_MODELS)
    for name, size in billions.items():
        assert resolve_shape(name)[1].n_params.total / 1e9 == pytest.approx(size, rel=1e-3), name


def test_config_file_and_name_agree(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(KNOWN_MODELS["llama-2-7b"]))
    name, shape = resolve_shape(tmp_path)
    assert name == tmp_path.name and shape == resolve_shape("LLAMA-2-7B")[1]
    assert isinstance(shape, ModelShape)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["gpt-5"], ["MODEL 'gpt-5': expected a model directory", "llama-3.1-70b"]),
        (["llama-2-7b", "--gpu", "Voodoo 3"], ["GPU: expected one of", "got 'Voodoo 3'"]),
        (["llama-2-7b", "--gpu", "h100", "--context", "0"], ["context=0"]),
        (["llama-2-7b", "--gpu", "h100", "--users", "0"], ["users=0"]),
        (["llama-2-7b", "--gpu", "h100", "--bits", "4", "--group-size", "100"], ["100"]),
        (["llama-2-7b", "--gpu", "h100", "--bits", "3"], ["'3' is not one of"]),
    ],
    ids=["unknown-model", "unknown-gpu", "context-0", "users-0", "group-100", "bits-3"],
)
def test_bad_input_is_one_line(capsys, args: list[str], needles: list[str]) -> None:
    code, _, err = run(capsys, "roofline", *args)
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
