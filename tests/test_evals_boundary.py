"""The error boundary every `python -m quantkit.evals...` program runs under (`run_main`): one
line on stderr and quantkit's exit code for what a user can cause or meet."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from quantkit.errors import CheckpointError
from quantkit.evals.common import run_main


def _raise(e: BaseException):
    def main() -> int:
        raise e

    return main


@pytest.mark.parametrize(
    ("main", "code", "words"),
    [
        (lambda: 7, 7, ""),
        (lambda: None, 0, ""),
        (lambda: ["rows"], 0, ""),
        (_raise(CheckpointError("expected a checkpoint, got none")), 3, "error: expected a"),
        (_raise(KeyboardInterrupt()), 130, "interrupted"),
        (_raise(MemoryError()), 5, "error: out of memory"),
        (_raise(OSError(errno.ENOSPC, "No space left on device", "out.json")), 4, "out.json"),
    ],
)
def test_each_failure_is_one_line_and_its_code(capsys, main, code: int, words: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_main(main)
    assert exit_.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == (1 if words else 0) and words in err


def test_a_benchmark_program_answers_bad_input_in_one_line(tmp_path) -> None:
    missing = tmp_path / "missing"
    run = subprocess.run(
        [sys.executable, "-m", "quantkit.evals.speed.prefill_tops", "--model", str(missing)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 3, run.stderr
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "does not exist" in lines[0], run.stderr
