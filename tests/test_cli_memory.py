"""Running out of memory is one line with its own exit status (5), never "internal error":
Python's MemoryError, torch's CPU allocator failing (a plain RuntimeError from alloc_cpu.cpp),
and the OS refusing memory (ENOMEM)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

OUT_OF_MEMORY = 5


def _fails_with(monkeypatch: pytest.MonkeyPatch, fail: object) -> None:
    import quantkit.cli.generate_cmd as generate_cmd

    def load(*args: object, **kwargs: object) -> None:
        if callable(fail):
            fail()
        raise fail  # type: ignore[misc]

    monkeypatch.setattr(generate_cmd, "load", load)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "internal error" not in err and "Traceback" not in err, err
    return lines[0]


def test_torch_cannot_allocate(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real allocation failure: 2**62 bytes is more than any machine has.
    _fails_with(monkeypatch, lambda: torch.empty(2**62, dtype=torch.uint8))
    code, _, err = run_cli(capsys, "generate", str(tiny_model_dir), "--prompt", "hi")
    line = _one_line(err)
    assert code == OUT_OF_MEMORY, err
    assert line.startswith("error: out of memory: the machine could not give an allocation")
    assert "(4294967296.00 GiB asked for at once)" in line


@pytest.mark.parametrize(
    "error", [MemoryError(), OSError(errno.ENOMEM, "Cannot allocate memory")], ids=["py", "os"]
)
def test_memory_errors_have_their_own_status(
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
) -> None:
    _fails_with(monkeypatch, error)
    code, _, err = run_cli(capsys, "generate", str(tiny_model_dir), "--prompt", "hi")
    assert code == OUT_OF_MEMORY and "out of memory" in _one_line(err), (code, err)


def test_another_runtime_error_is_still_a_bug(
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path))
    _fails_with(monkeypatch, RuntimeError("shape mismatch"))
    code, _, err = run_cli(capsys, "generate", str(tiny_model_dir), "--prompt", "hi")
    assert code == 70 and "internal error: RuntimeError: shape mismatch" in err, (code, err)
