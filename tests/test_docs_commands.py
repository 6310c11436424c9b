"""Every `python -m quantkit...` command that the README and ARCHITECTURE.md show still runs:
each module is found and answers `--help` with exit status 0. A module that moved without the
docs following it fails here, naming the document and the command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "ARCHITECTURE.md")
COMMAND = re.compile(r"python3? -m (quantkit(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")

# Runs in one child process (importing torch once, not once a module): each module as
# __main__ with argv [module, --help]; argparse's --help exits 0 after printing the usage.
_CHILD = r"""
import contextlib, io, json, runpy, sys
out = {}
for module in json.loads(sys.argv[1]):
    sys.argv = [module, "--help"]
    status, text = None, io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        status, text = 1, io.StringIO(f"{type(e).__name__}: {e}")
    out[module] = [status, text.getvalue()[-300:]]
print(json.dumps(out))
"""


def documented_modules() -> dict[str, str]:
    """module -> the first document that shows it."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for module in COMMAND.findall((ROOT / doc).read_text()):
            found.setdefault(module, doc)
    return found


def test_the_docs_show_python_m_commands() -> None:
    # The collection itself can fail (a renamed doc, a changed spelling): at least the kernel,
    # decode and grammar benchmarks are documented.
    modules = documented_modules()
    assert {
        "quantkit.evals.kernels.bench_w4a16",
        "quantkit.evals.speed.decode_phases",
        "quantkit.evals.grammar.jsonschema",
    } <= set(modules)


def test_every_documented_python_m_command_answers_help() -> None:
    modules = documented_modules()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(sorted(modules))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    failed = {
        f"{modules[m]}: python -m {m} --help": f"exit {status}: {tail}"
        for m, (status, tail) in results.items()
        if status != 0
    }
    assert failed == {}
