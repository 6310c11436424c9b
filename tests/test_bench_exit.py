"""`python -m quantkit.evals.grammar.jsonschema` and `quantkit generate` end cleanly: with
grammar builds abandoned at --compile-timeout still running (they crashed the interpreter's
finalization: "Segmentation fault" after the table), and on Ctrl-C (one line, exit 130, as
`quantkit`).

The builds are llguidance's, of the fixture subset's Github_ultra schema (~0.25 s for a small
vocabulary), abandoned at a limit of 1 ms; the interrupts land at fixed calls
(tests/test_cli_interrupts.py's wrapper), not after a sleep.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_cli_interrupts import INTERRUPTED, NOTHING_WRITTEN, run_interrupted

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "jsonschemabench"
BENCH = "quantkit.evals.grammar.jsonschema"
ULTRA = DATA / "maskbench" / "data" / "Github_ultra---o32645.json"


def _bench_args(model: Path, *more: str | Path) -> list[str | Path]:
    return ["--data", DATA, "--model", model, "--engine", "llguidance", "--no-generate",
            "--no-cache", *more]  # fmt: skip


def test_builds_past_the_limit_do_not_crash_the_exit(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", BENCH,
         *map(str, _bench_args(tiny_model_dir, "--compile-timeout", "0.001", "--category",
                               "Github_ultra", "--per-category", "1"))],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "not compiled (compile timeout)" in proc.stdout, proc.stdout
    assert "1 schemas in" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr


_EXIT = r"""
import atexit, json, sys, threading
sys.path.insert(0, sys.argv[1])
from quantkit.errors import GrammarError
from quantkit.grammar.compiler import compile_grammar
from quantkit.grammar.constraints import schema_grammar
from tests.hand_vocab import vocab_of

from quantkit.grammar.native_threads import exit_process, still_running

schema = json.loads(open(sys.argv[2]).read())["schema"]
vocab = vocab_of([chr(c) for c in range(32, 127)])
try:
    compile_grammar(schema_grammar(schema), vocab, engine="llguidance", timeout_s=0.001)
except GrammarError as e:
    assert "longer than the limit" in str(e), e
atexit.register(print, "atexit ran")
assert still_running(), "the build was meant to outlast its limit"
print("the report", end="")  # not flushed yet: the exit must flush it
exit_process(3, settle_s=0.0)  # do not wait: the build is surely still running
"""


def test_the_exit_leaves_a_running_build_behind_safely(tmp_path: Path) -> None:
    """A build still running after the wait: the atexit callbacks run, stdout is flushed, the
    exit code is kept, and the interpreter is not finalized under the build."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT)
    proc = subprocess.run(
        [sys.executable, str(script), str(ROOT), str(ULTRA)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout == "the reportatexit ran\n", proc.stdout


def test_ctrl_c_during_a_build_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The first Ctrl-C while the main thread waits for the build thread, a second in an
    atexit callback: one line, exit 130."""
    args = _bench_args(tiny_model_dir, "--category", "Github_ultra", "--per-category", "1")
    ran = run_interrupted(
        *args, folder=tmp_path, module=BENCH, first="threading:Thread.join", then="atexit"
    )
    assert ran.sent == ["threading:Thread.join", "atexit"], ran
    assert "Traceback" not in ran.err and "Exception ignored" not in ran.err, ran.err
    assert ran.code == INTERRUPTED and ran.err.strip() == NOTHING_WRITTEN, (ran.code, ran.err)


def test_ctrl_c_names_the_report_written_so_far(tiny_model_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = _bench_args(
        tiny_model_dir, "--category", "Github_ultra", "--category", "Kubernetes",
        "--per-category", "1", "--json", report,
    )  # fmt: skip
    first = "quantkit.grammar.llguidance.engine:compile_llguidance#2"  # the second schema's
    ran = run_interrupted(*args, folder=tmp_path, module=BENCH, first=first)
    assert ran.sent == [first], ran
    assert "Traceback" not in ran.err, ran.err
    assert ran.code == INTERRUPTED, (ran.code, ran.err)
    assert ran.err.strip() == f"interrupted; the report so far is in {report}", ran.err
    assert len(json.loads(report.read_text())["results"]) == 1


def test_generate_with_a_build_past_the_limit_exits_cleanly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The CLI too: the llguidance build abandoned at the limit still runs when the command
    ends; the exit is the grammar error's, not a crash in finalization (exit 139 before)."""
    schema = tmp_path / "ultra.json"
    schema.write_text(json.dumps(json.loads(ULTRA.read_text())["schema"]))
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli.main", "generate", str(tiny_model_dir),
         "--schema", str(schema), "--grammar-engine", "llguidance", "--compile-timeout", "0.001",
         "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert "longer than the limit" in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])  # a GrammarError's
    assert "Traceback" not in proc.stderr and "Segmentation" not in proc.stderr, proc.stderr
