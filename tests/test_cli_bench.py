"""`quantkit bench`: a small end-to-end run on a tiny model (table, --json, --plot), and bad input
refused with one line and a non-zero exit before any model is loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli as run

REQUIRED = {
    "mode", "batch_cap", "rate", "chunked_prefill", "throughput_tok_s", "ttft_ms_p50",
    "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "goodput_req_s", "mbu",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


SMALL = (
    "--requests", "4", "--prompt-len", "4-12", "--output-len", "3-5", "--batch-caps", "1,2",
    "--long-prompts", "0.5:40", "--chunk", "8", "--prompts", "random", "--threads", "1",
)  # fmt: skip


def test_bench_table_json_and_plots(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    report_path, plots = tmp_path / "bench.json", tmp_path / "plots"
    code, out, err = run(
        capsys, "bench", str(tiny_model_dir), *SMALL, "--rates", "200,inf",
        "--slo-tpot", "50ms", "--json", str(report_path), "--plot", str(plots),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(report_path.read_text())
    records = report["records"]
    # Per rate: continuous cap 1 (static cap 1 is the same schedule), static and continuous
    # cap 2; then the long-prompt workload without and with chunked prefill.
    assert [(r["mode"], r["batch_cap"], r["rate"], r["chunk"]) for r in records] == [
        ("continuous", 1, 200.0, None), ("static", 2, 200.0, None),
        ("continuous", 2, 200.0, None), ("continuous", 1, "inf", None),
        ("static", 2, "inf", None), ("continuous", 2, "inf", None),
        ("continuous", 2, "inf", None), ("continuous", 2, "inf", 8),
    ]  # fmt: skip
    for r in records:
        assert REQUIRED <= r.keys()
        assert r["completed"] == 4 and r["throughput_tok_s"] > 0
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["tpot_ms_p50"] <= r["tpot_ms_p99"]
        assert r["mbu"] > 0 and len(r["samples"]["ttft_ms"]) == 4
    assert [r["chunked_prefill"] for r in records[-2:]] == [False, True]
    assert report["slo"] == {"ttft_s": 2.0, "tpot_s": 0.05}
    assert [p["batch"] for p in report["roofline"]["points"]][0] == 1
    # The table prints the same numbers as the report.
    for r in records:
        row = f"{r['throughput_tok_s']:.1f}"
        assert re.search(rf"^{r['mode']}\*? +{r['batch_cap']} .*{re.escape(row)}", out, re.M)
    assert "chunked prefill (8 tokens/step, cap 2, rate inf): TPOT p99" in out
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["chunked_prefill_cdf.png", "roofline.png", "throughput_vs_tpot.png"]
    for name in pngs:
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("act", ["float32", "auto"])
def test_bench_reports_the_activation_dtype(
    tiny_model_dir: Path, tmp_path: Path, capsys, act: str
) -> None:
    """An INT4 model on the C step: `auto` takes the activations measured fastest here (int8
    with AVX512-VNNI, else bf16 on AMD with AVX512-BF16), and the roofline's compute roof
    is a bf16 matmul's with bf16 ones (an fp32 matmul's otherwise)."""
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model
    from quantkit.runtime.fast_path import bf16_activations_faster, int8_activations_faster

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto"))
    ckpt = outcome.save(tmp_path / "int4", source_dir=tiny_model_dir)
    report_path = tmp_path / "bench.json"
    code, out, err = run(
        capsys, "bench", str(ckpt), *SMALL, "--rates", "inf", "--modes", "continuous",
        "--long-prompts", "0", "--act-dtype", act, "--json", str(report_path),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(report_path.read_text())
    want = "float32"
    if act == "auto":
        want = "int8" if int8_activations_faster() else want
        want = "bfloat16" if want == "float32" and bf16_activations_faster() else want
    roof = "bfloat16" if want == "bfloat16" else "float32"
    assert report["meta"]["act_dtype"] == want and report["roofline"]["dtype"] == roof
    assert (
        report["roofline"]["flops_source"]
        == f"measured {roof} 1024x1024 matmul (fastest repetition)"
    )
    assert (f"{want} activations in the INT4 GEMVs" in err) == (want != "float32")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rates", "0"], "--rates: expected a positive number of requests/s or inf, got '0'"),
        (["--rates", "2,-1"], "--rates: expected a positive number of requests/s or inf, got '-1'"),
        (["--rates", "fast"], "--rates: expected a positive number"),
        (["--prompt-len", "0"], "--prompt-len: expected N, LO-HI or lognormal:MEDIAN:SIGMA"),
        (["--output-len", "-4"], "--output-len: expected N, LO-HI or lognormal:MEDIAN:SIGMA"),
        (["--output-len", "30-10"], "--output-len: expected N, LO-HI"),
        (["--requests", "0"], "--requests: expected an integer >= 1, got 0"),
        (["--slo-tpot", "50"], "--slo-tpot: expected a positive duration with a unit"),
        (["--slo-ttft", "-1s"], "--slo-ttft: expected a positive duration with a unit"),
        (["--slo-tpot", "0ms"], "--slo-tpot: expected a positive duration, got '0ms'"),
        (["--batch-caps", "0"], "--batch-caps: expected integers >= 1 separated by commas"),
        (["--batch-caps", "1,0,8"], "--batch-caps: expected integers >= 1"),
        (["--chunk", "-1"], "--chunk: expected an integer >= 0, got -1"),
        (["--long-prompts", "2:100"], "--long-prompts: expected FRAC:LEN"),
        (["--long-prompts", "0.5:0"], "--long-prompts: expected FRAC:LEN"),
        (["--modes", "orca"], "modes: expected static and/or continuous, got orca"),
        (["--admission-limit", "0"], "--admission-limit: expected an integer >= 1, got 0"),
        (["--threads", "0"], "--threads: expected an integer >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(
    args: list[str], message: str, tmp_path: Path, capsys
) -> None:
    # A path that does not exist: the options are checked before anything is loaded.
    code, out, err = run(capsys, "bench", str(tmp_path / "no-such-model"), *args)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert "Traceback" not in err and out == ""


def test_plot_labels_of_coinciding_caps_are_merged() -> None:
    """At an arrival-bound rate every cap lands on one point: one label names them all."""
    from quantkit.evals.speed.plots import _merge_close

    points = [(3.8, 207.1, 1), (4.0, 233.8, 4), (4.05, 234.2, 8), (6.4, 835.8, 16)]
    assert _merge_close(points, 0.5, 6.0) == [
        ((3.8, 207.1), [1]),
        ((4.0, 233.8), [4, 8]),
        ((6.4, 835.8), [16]),
    ]
