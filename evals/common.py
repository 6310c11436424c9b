"""What every measurement in `quantkit.evals` shares: the commit a number was measured at, one
atomic JSON writer for reports (a reader sees the old report or the whole new one), and the
error boundary of every `python -m quantkit.evals...` program (`run_main`)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from quantkit.errors import QuantkitError
from quantkit.paths import atomic_file


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def write_json_atomic(
    path: Path, data: Any, *, indent: int | None = 1, default: Any = None
) -> None:
    """Write `data` as JSON to `path` through a temporary file beside it and a rename (a reader
    sees the old report or the whole new one); `indent` and `default` as for json.dumps."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=indent, default=default))


def print_and_save(results: Any, table: str, json_path: str | Path | None) -> None:
    """The tail of every study and benchmark script: print its table, and write the results as
    JSON (atomically) when `--json PATH` was given."""
    print(table)
    if json_path:
        write_json_atomic(Path(json_path), results)


def run_main(main: Callable[[], object]) -> NoReturn:
    """Run a benchmark's `main` as a program: what a user can cause or meet ends in one line on
    stderr and the exit code `quantkit` gives it (a quantkit error its own, out of memory 5, the
    machine 4, Ctrl-C 130); `main`'s int is the exit code, anything else 0. An unexpected
    exception keeps its traceback: in a benchmark it is a bug, and the traceback is its report."""
    try:
        result = main()
        code = result if isinstance(result, int) else 0
    except QuantkitError as e:
        code = _say(f"error: {e}", getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        code = _say("interrupted", 130)
    except MemoryError:
        code = _say("error: out of memory", 5)
    except BrokenPipeError:  # `... | head`: the reader left
        code = 0
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        words = e.strerror or str(e)
        code = _say(f"error: {words}{where}", 5 if e.errno == errno.ENOMEM else 4)
    sys.exit(code)


def _say(line: str, code: int) -> int:
    print(line, file=sys.stderr)
    return code
