"""The kernel benchmark runs on CPU, writes its CSV and summarises SmolLM2 decode."""

from __future__ import annotations

import csv

import pytest

import quantkit.fused_kernels.cpu.w4a16 as cpu
from quantkit.evals.kernels import bench_w4a16 as bench


@pytest.fixture(autouse=True)
def kernel_home(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QUANTKIT_BACKEND", raising=False)
    cpu._library.cache_clear()
    yield
    cpu._library.cache_clear()


def test_bench_smollm2_decode_writes_csv(tmp_path, capsys) -> None:
    out = tmp_path / "bench.csv"
    args = ["--device", "cpu", "--shapes", "smollm2", "--m", "1,600", "--budget", "0"]
    args += ["--impls", "int4,dense-bf16", "--max-prefill-gflop", "0.5", "--sweep-mb", "0.1"]
    rows = bench.main([*args, "--csv", str(out)])
    printed = capsys.readouterr().out
    assert "copy bandwidth (read + write)" in printed
    # 4 shapes x 2 impls at M=1; M=600 (the prefill path) only where 2*M*N*K <= 0.5 GFLOP:
    # q/o 576x576 and k/v 192x576 run, gate/up and down (1.06 GFLOP) are skipped
    assert len(rows) == 12
    assert "skipped 2 measurements" in printed and "M=600" in printed
    assert "SmolLM2-135M linears per decoded token" in printed
    assert "vs dense-bf16" in printed
    for r in rows:
        assert 0 < r.p20_ms <= r.median_ms <= r.p80_ms
        assert r.weight_gbps > 0 and r.copy_gbps > 0 and r.tflops > 0
    int4 = [r for r in rows if r.impl == "int4 cpu"]
    dense = [r for r in rows if r.impl == "dense-bf16"]
    assert len(int4) == len(dense) == 6
    # the INT4 layer reads ~1/4 of the bf16 bytes (+ scales and zero points)
    assert all(
        0.25 < i.weight_bytes / d.weight_bytes < 0.3 for i, d in zip(int4, dense, strict=True)
    )
    with out.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for col in ("device_name", "versions", "commit", "median_ms", "mbu", "tflops", "weight_gbps"):
        assert col in table[0]
    assert "torch" in table[0]["versions"]


def test_bench_rejects_unknown_shapes() -> None:
    with pytest.raises(SystemExit, match="expected smollm2, llama3-8b or NxK"):
        bench.main(["--device", "cpu", "--shapes", "gpt5", "--m", "1"])
