"""The memory a streamed quantization will need, estimated from the headers before it starts:
a run that cannot fit is refused in one line with both numbers and the option that lowers it."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.quantize import memory_plan
from quantkit.quantize.memory_plan import InsufficientMemoryError, check_memory, plan_memory
from quantkit.quantize.source_model import open_source
from tests.conftest import run_cli


def test_each_option_grows_the_phase_it_belongs_to(tiny_model_dir: Path) -> None:
    source = open_source(tiny_model_dir)
    base = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=False,
                       score=False)  # fmt: skip
    awq = plan_memory(source, calibrated="awq", samples=64, seq_len=512, quantize_head=False,
                      score=False)  # fmt: skip
    more = plan_memory(source, calibrated="awq", samples=128, seq_len=512, quantize_head=False,
                       score=False)  # fmt: skip
    head = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=True,
                       score=True)  # fmt: skip
    assert base.phases["decoder layer"] < awq.phases["decoder layer"] < more.phases["decoder layer"]
    assert head.phases["embedding and head"] > base.phases["embedding and head"]
    assert "perplexity" in head.phases and "perplexity" not in base.phases
    assert base.peak > memory_plan.RUNTIME_BYTES


def test_a_run_that_cannot_fit_names_both_numbers_and_the_remedy(tiny_model_dir: Path) -> None:
    source = open_source(tiny_model_dir)
    plan = plan_memory(source, calibrated="gptq", samples=4096, seq_len=2048,
                       quantize_head=False, score=False)  # fmt: skip
    check_memory(plan, available=plan.peak)  # exactly enough is enough
    with pytest.raises(InsufficientMemoryError, match=r"--calib-samples, now 4096\) lowers it"):
        check_memory(plan, available=2**30)
    scored = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=False,
                         score=True)  # fmt: skip
    scored.phases["perplexity"] = 10**12  # as if the model were large
    with pytest.raises(InsufficientMemoryError, match=r"--eval-tokens 0 .* lowers it"):
        check_memory(scored, available=2**33)


def test_the_cli_refuses_before_reading_weights(tiny_model_dir: Path, tmp_path: Path, capsys,
                                                monkeypatch) -> None:  # fmt: skip
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 100 * 2**20)
    code, out, err = run_cli(capsys, "quantize", str(tiny_model_dir), "--method", "rtn",
                             "--eval-tokens", "0", "-o", str(tmp_path / "out"))  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 5 and len(lines) == 1 and "Traceback" not in err, err
    assert "expected at most 0.1 GB available" in lines[0] and "estimated peak" in lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_available_memory_is_read(monkeypatch) -> None:
    got = memory_plan.available_bytes()
    assert got is None or got > 0
