"""The memory a streamed quantization will need, estimated from the headers before it starts:
a run that cannot fit is refused in one line with both numbers and the option that lowers it."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from quantkit.quantize import memory_plan
from quantkit.quantize.memory_plan import InsufficientMemoryError, check_memory, plan_memory
from quantkit.quantize.source_model import open_source
from tests.conftest import TINY_LLAMA, make_hf_model, run_cli


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


def _scored(model_dir: Path) -> memory_plan.MemoryPlan:
    return plan_memory(open_source(model_dir), calibrated=None, samples=0, seq_len=512,
                       quantize_head=False, score=True)  # fmt: skip


def _logits(vocab: int) -> int:
    return 4 * memory_plan.PERPLEXITY_BATCH * memory_plan.PERPLEXITY_WINDOW * vocab


def test_the_perplexity_holds_a_batch_of_logits_and_a_window_of_log_probs(
    tmp_path: Path, monkeypatch
) -> None:
    # The batch's logits and one window's log-probabilities (`perplexity` takes them a row at a
    # time; a final soft-cap in place): measured peak 7848 MiB on a 4-layer Gemma-2-2B shape
    # (12312 when four batches lived at once), estimated 8664.
    small = _scored(make_hf_model(tmp_path / "small", {"vocab_size": 512}))
    large = _scored(make_hf_model(tmp_path / "large", {"vocab_size": 4096}))
    per_batch = 1 + 1 / memory_plan.PERPLEXITY_BATCH
    grown = large.phases["perplexity"] - small.phases["perplexity"]
    assert grown >= per_batch * (_logits(4096) - _logits(512))
    assert large.phases["perplexity"] >= per_batch * _logits(4096)
    monkeypatch.setattr(memory_plan, "PERPLEXITY_WINDOW", 2 * memory_plan.PERPLEXITY_WINDOW)
    wider = _scored(tmp_path / "large")
    assert wider.phases["perplexity"] - large.phases["perplexity"] >= per_batch * _logits(4096)


def test_a_final_soft_cap_costs_no_more_logits(tiny_model_dir: Path) -> None:
    # It is taken in place (`CausalLM.logits`).
    source = open_source(tiny_model_dir)
    plain = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=False,
                        score=True)  # fmt: skip
    source.shell.config = replace(source.shell.config, final_softcap=30.0)
    capped = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=False,
                         score=True)  # fmt: skip
    assert capped.phases["perplexity"] == plain.phases["perplexity"]


def test_a_tied_head_is_the_embedding_counted_once(tmp_path: Path) -> None:
    tied = open_source(make_hf_model(tmp_path / "tied", {"tie_word_embeddings": True}))
    untied = open_source(make_hf_model(tmp_path / "untied", {"tie_word_embeddings": False}))
    vocab, hidden = TINY_LLAMA["vocab_size"], TINY_LLAMA["hidden_size"]
    # fp32 weights, nothing left in the heap: the model is the tensors read, so an untied
    # head is 4 bytes a parameter more and a tied one nothing.
    grown = memory_plan._perplexity(untied, 0) - memory_plan._perplexity(tied, 0)
    assert grown == 4 * vocab * hidden


def test_the_tokenizer_and_text_count_only_when_loaded(tiny_model_dir: Path) -> None:
    source = open_source(tiny_model_dir)
    bare = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=False,
                       score=False)  # fmt: skip
    scored = plan_memory(source, calibrated=None, samples=0, seq_len=512, quantize_head=False,
                         score=True)  # fmt: skip
    tokenizer = (tiny_model_dir / "tokenizer.json").stat().st_size
    assert bare.runtime == memory_plan.RUNTIME_BYTES
    assert scored.runtime == (memory_plan.RUNTIME_BYTES + memory_plan.TOKENIZER_BYTES
                              + memory_plan.TOKENIZER_PER_FILE_BYTE * tokenizer
                              + memory_plan.TEXT_BYTES)  # fmt: skip


def test_calibration_activations_are_fp32_four_copies_at_once(tiny_model_dir: Path) -> None:
    source = open_source(tiny_model_dir)
    hidden = source.shell.config.hidden_size
    plans = {
        n: plan_memory(
            source, calibrated="gptq", samples=n, seq_len=512, quantize_head=False, score=False
        )
        for n in (64, 128)
    }
    grown = plans[128].phases["decoder layer"] - plans[64].phases["decoder layer"]
    assert grown >= 4 * 4 * 64 * 512 * hidden


def test_the_estimate_and_its_phase_are_printed(tiny_model_dir: Path, tmp_path: Path,
                                                capsys) -> None:  # fmt: skip
    code, out, err = run_cli(capsys, "quantize", str(tiny_model_dir), "--method", "rtn",
                             "--eval-tokens", "1100", "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("peak RSS"))
    # A tiny model's working sets are far below the runtime's: the perplexity's is the largest.
    assert re.search(r"at most \d+ MB, in the perplexity phase\)$", line), line
    assert f"window {memory_plan.PERPLEXITY_WINDOW}" in out
