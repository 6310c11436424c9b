"""What every measurement in `quantkit.evals` shares: the commit a number was measured at, and
one atomic JSON writer for reports (a reader sees the old report or the whole new one)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

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
