"""Where quantkit keeps its files, and the two file-system primitives every writer uses.

- `quantkit_home`: the cache root (converted models, checkpoints, kernels, grammar indexes,
  calibration text, the measured bandwidth).
- `file_lock`: one process at a time does a once-per-machine job (a conversion, a build, the
  embedded model's quantization); the others wait, then find the result.
- `replace_dir`: a finished temporary directory takes a target's place atomically; an existing
  target is moved aside first and put back if the swap fails, so a crash never leaves a half
  directory, nor loses the old one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOME_ENV = "QUANTKIT_HOME"
# The project's data folder (benchmarks/, jsonschemabench/, json-schema-test-suite/): only ever
# named by the user, never defaulted, so nothing reads data from beside the repository.
DATA_ENV = "QUANTKIT_DATA"


def quantkit_home(home: Path | str | None = None) -> Path:
    """The cache root: `home` if given, else $QUANTKIT_HOME, else ~/.cache/quantkit."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"


def data_folder(
    sub: str, *, explicit: str | Path | None = None, env: str | None = None
) -> Path | None:
    """A data set's folder: `explicit` (a flag), else $`env` (the set's own variable), else
    $QUANTKIT_DATA/`sub`; None when nothing names one (the caller says what to set)."""
    if explicit:
        return Path(explicit).expanduser()
    own = os.environ.get(env) if env else None
    if own:
        return Path(own).expanduser()
    shared = os.environ.get(DATA_ENV)
    return Path(shared).expanduser() / sub if shared else None


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (created with its folder if missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; the atomic rename still prevents half directories
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def replace_dir(new: Path, target: Path) -> None:
    """Rename the finished `new` to `target`; an existing `target` is moved aside first, put back
    untouched if the rename fails, and deleted only once `new` stands in its place."""
    if not target.exists():
        os.replace(new, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old, target)
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()
