"""The int8 peak micro-benchmark and the prefill TOPS report, on a tiny random INT4 model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.evals.kernels import vnni_peak
from quantkit.evals.speed import prefill_tops
from quantkit.format.scheme import QuantScheme
from quantkit.models.config import ModelConfig
from quantkit.quantize.pipeline import quantize_model


def _vnni() -> bool:
    from quantkit.fused_kernels.cpu.int8 import int8_cpu_available

    return int8_cpu_available()


def test_the_peak_counts_every_product_of_every_thread() -> None:
    """qk_int8_peak_ops returns the operations its loop ran: 12 vpdpbusd a round, 64 products
    and 64 adds each, on every thread; 0 where the build has no VNNI."""
    from quantkit.fused_kernels.cpu.int8 import _library

    ops = _library().qk_int8_peak_ops(1000, 2)
    assert ops == (2 * 1000 * 12 * 128 if _vnni() else 0)
    assert _library().qk_int8_peak_ops(10, 0) == (10 * 12 * 128 if _vnni() else 0)


def test_the_peak_benchmark_prints_gops_or_says_why_not(capsys) -> None:
    code = vnni_peak.main(["--threads", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    if _vnni():
        assert code == 0 and "1 thread:" in out and "int8 GOPS" in out
        assert vnni_peak.peak_gops(1, repeats=1, rounds=1000) > 0
    else:
        assert code == 2 and "no AVX512-VNNI" in out


def test_macs_per_token_counts_each_matmul_once(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_dict(json.loads((tiny_llama_dir / "config.json").read_text()))
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    want = config.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)
    assert prefill_tops.macs_per_token(config) == want
    # the last layer's o and MLP for the last row alone: 9 rows fewer of them at 10 tokens
    last = q * h + 3 * h * i
    assert prefill_tops.prefill_macs(config, 10, last_row_only=False) == 10 * want
    assert prefill_tops.prefill_macs(config, 10, last_row_only=True) == 10 * want - 9 * last
    assert prefill_tops.prefill_macs(config, 1, last_row_only=True) == want


@pytest.fixture(scope="module")
def int4_ckpt(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    outcome = quantize_model(tiny_llama_dir, scheme=QuantScheme("int4", "auto", False))
    return outcome.save(tmp_path_factory.mktemp("ckpt") / "int4", source_dir=tiny_llama_dir)


def test_the_report_gives_each_run_its_gops_and_phases(int4_ckpt: Path, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--model", str(int4_ckpt), "--tokens", "40", "--repeats", "2", "--threads", "1"]
    assert prefill_tops.main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert len(r["runs"]) == 2 and r["tokens"] == 40 and "median" in printed
    for run in r["runs"]:
        assert run["tok_s"] == pytest.approx(40 / run["seconds"])
        assert run["gops"] > 0
        if r["c_step"]:  # the matmuls are part of the prefill
            assert 0 < run["matmul_s"] <= run["seconds"]
    assert (r["peak_gops"] is not None) == _vnni()
    full = r["macs_per_token"] * 40
    assert r["macs"] < full if r["last_row_only"] else r["macs"] == full
    assert r["last_row_only"] == (r["c_step"] and _vnni())  # int8 activations where VNNI is
    assert ("for the last token only" in printed) == r["last_row_only"]


def test_the_report_refuses_counts_below_one(int4_ckpt: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        prefill_tops.main(["--model", str(int4_ckpt), "--tokens", "0"])
    assert e.value.code == 2
    assert "expected >= 1, got 0" in capsys.readouterr().err
