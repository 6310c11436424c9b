"""The llama.cpp peer benchmark's argument checks (the benchmark itself needs a llama.cpp build
and runs outside the suite)."""

from __future__ import annotations

from pathlib import Path

from quantkit.evals.peers.llamacpp import _tests, main


def test_convert_refuses_a_type_it_does_not_know(tmp_path: Path, capsys) -> None:
    code = main(["convert", str(tmp_path), "-o", str(tmp_path / "out"), "--types", "q5_k"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err
    assert err.startswith("error: --types: expected some of q4_0, q4_1, q4_k_m, q8_0, got 'q5_k'")
    assert not (tmp_path / "out").exists()  # nothing made before the check


def test_prefill_tests_take_each_prompt_length_and_fit_the_window() -> None:
    tests, notes = _tests([0], 4096, (512, 4096))
    prompts = [(t.name, t.prompt) for t in tests if t.depth < 0]
    assert prompts == [("prefill 512", 512), ("prefill 4095", 4095)]
    assert notes == [
        "prefill 4096 runs at 4095: 4095 + 1 tokens fill the model's 4096-token window"
    ]


def test_decode_refuses_a_prompt_length_below_one(capsys) -> None:
    code = main(["decode", "--prompts", "512", "0"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err == "error: --prompts: expected integers >= 1, got [512, 0]"


def test_the_table_gives_each_run_s_own_ratio_beside_the_medians_ratio() -> None:
    """A host whose bandwidth drifts moves both engines of a run (run 2 slow for both, run 3
    slow for quantkit's half): the medians' ratio mixes runs (64 / 50 = 1.28x); the runs' own
    ratios are 1.60, 1.50 and 1.28x, their median 1.50x."""
    from quantkit.evals.peers.llamacpp import Row, _decode_table

    rows = [Row("decode d=0", "quantkit", [80.0, 60.0, 64.0]),
            Row("decode d=0", "llama.cpp a", [50.0, 40.0, 50.0])]  # fmt: skip
    table = _decode_table(rows, 3, "llama.cpp a")
    line = next(x for x in table.splitlines() if "quantkit" in x)
    assert line.split()[-2:] == ["1.28x", "1.50x"], table
    assert table.splitlines()[0].split()[-1] == "paired"
