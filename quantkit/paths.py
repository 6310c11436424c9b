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
import tempfile
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


def ordinary_mode(path: Path) -> None:
    """Give `path` the permissions an ordinary mkdir/open would (umask applied): mkdtemp makes
    folders 0700, mkstemp files 0600 and safetensors writes 0600, so without this a checkpoint
    or cache made by one user could not be read by the others on the machine."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_file(path: Path, *, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary file beside `path` to write, renamed onto `path` when the block ends
    normally (with ordinary permissions, not mkstemp's 0600) and removed when it raises: a
    reader sees the old file or the whole new one, never half of it."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        ordinary_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_readable(folder: Path) -> None:
    """`ordinary_mode` for `folder` and every file in it."""
    ordinary_mode(folder)
    for f in folder.iterdir():
        if f.is_file():
            ordinary_mode(f)


# Targets `replace_dir` has put in place in this process: an interruption after one of them
# must not be reported as "nothing was written" (the CLI's boundary reads this).
WRITTEN: list[Path] = []
# Work a failed or interrupted command keeps for its next run to continue (a quantization's
# finished layers): the CLI's one last line says where it is and how to go on.
KEPT: list[str] = []


def temp_sibling(target: Path, kind: str) -> Path:
    """A hidden name beside `target` for a temporary ("tmp") or displaced ("old") directory,
    carrying this process's id so `sweep_leftovers` can tell a live writer from a dead one."""
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sweep_leftovers(target: Path) -> list[str]:
    """Clean what a killed writer (SIGKILL, power loss) left beside `target`, and say what.

    A `.tmp-` directory of a dead process is half written: removed. An `.old-` directory of a dead
    process is a previous `target` moved aside: put back if `target` is missing (the crash came
    between the two renames, so nothing is lost), else removed (its replacement stands)."""
    done = []
    for path in sorted(target.parent.glob(f".{target.name}.*-*-*")):
        kind, _, rest = path.name[len(target.name) + 2 :].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not target.exists():
            os.replace(path, target)
            done.append(f"restored {target} from an interrupted replacement")
        else:
            _remove(path)
            done.append(f"removed {path.name}, left by an interrupted write")
    return done


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace_dir(new: Path, target: Path) -> None:
    """Rename the finished `new` to `target`; an existing `target` is moved aside first, put back
    untouched if the rename fails, and deleted only once `new` stands in its place (a Ctrl-C
    during that deletion waits for it: the old directory is never left half deleted)."""
    if not target.exists():
        os.replace(new, target)
        WRITTEN.append(target)
        return
    old = temp_sibling(target, "old")
    os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old, target)
        raise
    WRITTEN.append(target)
    with _interrupts_deferred():
        _remove(old)


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT until the block ends (main thread only; elsewhere signals do not land)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[object] = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
