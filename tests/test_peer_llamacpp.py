"""The llama.cpp peer benchmark's argument checks (the benchmark itself needs a llama.cpp build
and runs outside the suite)."""

from __future__ import annotations

from pathlib import Path

from quantkit.evals.peers.llamacpp import main


def test_convert_refuses_a_type_it_does_not_know(tmp_path: Path, capsys) -> None:
    code = main(["convert", str(tmp_path), "-o", str(tmp_path / "out"), "--types", "q5_k"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err
    assert err.startswith("error: --types: expected some of q4_0, q4_1, q4_k_m, q8_0, got 'q5_k'")
    assert not (tmp_path / "out").exists()  # nothing made before the check
