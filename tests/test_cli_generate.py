"""`quantkit generate` end to end on a tiny model (dense and INT4), and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli as run

KEYS = (
    "text finish_reason prompt_tokens generated_tokens ttft_ms tpot_ms_p50 tpot_ms_p99 "
    "decode_tok_s bytes_per_token ceiling_tok_s mbu device backend"
).split()


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def int4_ckpt(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto"))
    out = tmp_path_factory.mktemp("ckpt") / "tiny-rtn-int4"
    return outcome.save(out, source_dir=tiny_model_dir)


def test_json_has_the_documented_keys(tiny_model_dir: Path, capsys) -> None:
    code, out, err = run(
        capsys, "generate", str(tiny_model_dir), "--prompt", "Beautiful is better than",
        "--max-new-tokens", "8", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert set(KEYS) <= data.keys()
    assert data["finish_reason"] in ("stop", "length")
    assert 1 <= data["generated_tokens"] <= 8 and data["prompt_tokens"] > 0
    if data["decode_tok_s"] is not None:
        assert data["mbu"] == pytest.approx(data["decode_tok_s"] / data["ceiling_tok_s"])
    # Dense fp32, tied head: the head is the 512 x 64 embedding read in full.
    assert data["bytes_lm_head"] == 512 * 64 * 4
    assert data["backend"] == "dense float32 (torch)" and data["device"].startswith("cpu")
    assert data["head_dtype"] == "float32"  # dense models keep the head transformers uses
    assert data["act_dtype"] == "float32"  # and its activations


def test_streams_text_then_summary(int4_ckpt: Path, capsys) -> None:
    code, out, err = run(
        capsys, "generate", str(int4_ckpt), "--prompt", "Explicit is better",
        "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3", "--top-k", "40",
    )  # fmt: skip
    assert code == 0, err
    text, summary = out.split("\n---\n")
    for label in ("tokens", "TTFT", "TPOT", "decode", "bytes", "roofline", "device", "backend"):
        assert f"\n{label} " in "\n" + summary, label
    assert "rtn int4 g64 asymmetric" in summary and "MBU" in summary
    again = run(
        capsys, "generate", str(int4_ckpt), "--prompt", "Explicit is better",
        "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3", "--top-k", "40",
        "--json",
    )  # fmt: skip
    assert json.loads(again[1])["text"] == text.rstrip("\n")


def test_head_dtype_option(int4_ckpt: Path, capsys) -> None:
    common = ["generate", str(int4_ckpt), "--prompt", "Flat is", "--max-new-tokens", "3", "--json"]
    code, out, err = run(capsys, *common, "--head-dtype", "bfloat16")
    assert code == 0, err
    data = json.loads(out)
    assert data["head_dtype"] == "bfloat16" and data["bytes_lm_head"] == 512 * 64 * 2
    assert "lm_head bfloat16" in data["backend"]
    code, out, err = run(capsys, *common, "--head-dtype", "float32")
    assert code == 0, err
    assert json.loads(out)["bytes_lm_head"] == 512 * 64 * 4
    from quantkit.fused_kernels.cpu.i6_gemv import i6_gemv_available

    code, out, err = run(capsys, *common, "--head-dtype", "int6")
    if not i6_gemv_available():
        assert code != 0 and "head dtype int6: expected a CPU with AVX512-VNNI" in err
        return
    assert code == 0, err
    data = json.loads(out)
    # 32 tiles of 16 rows, 2 groups of 32: 384 bytes of codes and 16 fp16 scales each
    assert data["head_dtype"] == "int6 g32" and data["bytes_lm_head"] == 32 * 2 * (384 + 32)
    assert "lm_head int6 g32" in data["backend"]


def test_act_dtype_option(int4_ckpt: Path, capsys) -> None:
    from quantkit.runtime.fast_path import (
        bf16_activations_available,
        bf16_activations_faster,
        int8_activations_faster,
    )

    common = ["generate", str(int4_ckpt), "--prompt", "Flat is", "--max-new-tokens", "3", "--json"]
    code, out, err = run(capsys, *common, "--act-dtype", "float32")
    assert code == 0, err
    data = json.loads(out)
    assert data["act_dtype"] == "float32" and "in the INT4 GEMVs" not in data["backend"]
    code, out, err = run(capsys, *common)  # auto: the dtype measured fastest on this CPU
    assert code == 0, err
    want = "int8" if int8_activations_faster() else "float32"
    if want == "float32" and bf16_activations_faster():
        want = "bfloat16"
    assert json.loads(out)["act_dtype"] == want
    code, out, err = run(capsys, *common, "--act-dtype", "bfloat16")
    if not bf16_activations_available():
        assert code != 0 and "AVX512-BF16" in err and "Traceback" not in err
        return
    assert code == 0, err
    data = json.loads(out)
    assert data["act_dtype"] == "bfloat16"
    assert "float32 activations (bfloat16 in the INT4 GEMVs)" in data["backend"]


def test_kv_int8_head_and_act_options(int4_ckpt: Path, capsys) -> None:
    """--kv-dtype int8: named in the JSON and the backend line, the roofline counts 68 bytes a
    head and token; --head-dtype int8 halves the bf16 head's bytes (and its row scales);
    --act-dtype int8 runs where the CPU has VNNI, else one clear line."""
    from quantkit.runtime.fast_path import int8_activations_available

    common = ["generate", str(int4_ckpt), "--prompt", "Flat is", "--max-new-tokens", "3", "--json"]
    code, out, err = run(capsys, *common, "--kv-dtype", "int8", "--head-dtype", "int8")
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_dtype"] == "int8" and "int8 KV cache" in data["backend"]
    assert data["head_dtype"] == "int8" and data["bytes_lm_head"] == 512 * 64 + 512 * 4
    code, out, err = run(capsys, *common, "--kv-dtype", "float32")
    assert code == 0, err
    cfg = json.loads((int4_ckpt / "config.json").read_text())
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert data["bytes_kv"] * 4 * d == json.loads(out)["bytes_kv"] * (d + 4)
    code, out, err = run(capsys, *common, "--kv-dtype", "int4")
    _one_line_error(code, err, "--kv-dtype")
    code, out, err = run(capsys, *common, "--act-dtype", "int8")
    if not int8_activations_available():
        _one_line_error(code, err, "AVX512-VNNI")
        return
    assert code == 0, err
    assert json.loads(out)["act_dtype"] == "int8"


def test_default_model_is_the_cached_int4_checkpoint(
    int4_ckpt: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quantkit.quantize.embedded

    calls: list[bool] = []

    def fake() -> Path:
        calls.append(True)
        return int4_ckpt

    monkeypatch.setattr(quantkit.quantize.embedded, "ensure_embedded_int4", fake)
    code, out, err = run(capsys, "generate", "--prompt", "Hi", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert calls and json.loads(out)["model"] == str(int4_ckpt)


def test_embedded_checkpoint_is_made_once(tmp_path: Path, monkeypatch) -> None:
    import quantkit.quantize.embedded as embedded

    made: list[Path] = []

    def fake_quantize(target: Path, *, home: Path | None, progress: bool) -> None:
        made.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_quantize_embedded", fake_quantize)
    lines: list[str] = []
    first = embedded.ensure_embedded_int4(home=tmp_path, log=lines.append)
    again = embedded.ensure_embedded_int4(home=tmp_path, log=lines.append)
    assert first == again == tmp_path / "checkpoints" / "smollm2-135m-awq+gptq-int4"
    assert made == [first] and len(lines) == 2 and "first use: quantizing" in lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--prompt", ""], ["--prompt: expected some text, got an empty prompt"]),
        (["--prompt", "hi", "--max-new-tokens", "0"], ["max_new_tokens", ">= 1, got 0"]),
        (["--prompt", "hi", "--max-new-tokens", "-4"], ["max_new_tokens", "got -4"]),
        (["--prompt", "hi", "--top-p", "0"], ["top_p: expected a number in (0, 1], got 0.0"]),
        (["--prompt", "hi", "--top-p", "1.5"], ["top_p", "got 1.5"]),
        (["--prompt", "hi", "--temperature", "-0.5"], ["temperature", ">= 0, got -0.5"]),
    ],
    ids=["empty-prompt", "zero-tokens", "negative-tokens", "top-p-0", "top-p-1.5", "neg-temp"],
)
def test_bad_sampling_input(tiny_model_dir: Path, capsys, args: list[str], needles) -> None:
    code, _, err = run(capsys, "generate", str(tiny_model_dir), *args)
    _one_line_error(code, err, *needles)


def test_prompt_longer_than_the_context_window(tiny_model_dir: Path, capsys) -> None:
    code, _, err = run(
        capsys, "generate", str(tiny_model_dir), "--prompt", "Beautiful is better. " * 200
    )
    _one_line_error(code, err, "expected at most 255 tokens (context window 256")


def test_not_a_checkpoint_directory(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    code, _, err = run(capsys, "generate", str(folder), "--prompt", "hi")
    _one_line_error(code, err, str(folder), "found no config.json")
