"""The client side of the outlines-core compile process (`compile_worker`): start it once,
send it a request, enforce the time limit by killing it, and turn its answers into
GrammarErrors. Kept apart from `compiler` (engines, caches) so both stay small.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from quantkit.errors import GrammarError
from quantkit.grammar.cache_file import (
    DamagedEntryError,
    entry_key,
    read_entry,
    report_damage,
    write_entry,
)
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["run_worker"]

_STARTUP_TIMEOUT_S = 300.0


def _vocab_key(vocabulary: TokenVocabulary) -> str:
    return entry_key("vocab", vocabulary.fingerprint)


# Vocabulary files checked whole in this process, by (path, size, mtime): checked once, not per
# compile (a benchmark compiles hundreds of grammars over one vocabulary).
_checked: set[tuple[str, int, int]] = set()


def _vocab_file(vocabulary: TokenVocabulary, folder: Path, key: str) -> Path:
    """The cached vocabulary file the worker reads, checked whole and for `key` (one warning
    line and a rebuild when it is damaged), or written now."""
    path = folder / f"vocab-{key[:32]}.bin"
    if path.is_file():
        try:
            return _checked_vocab(path, key)
        except DamagedEntryError as damage:
            report_damage(damage)
            path.unlink(missing_ok=True)
    _, (data,) = vocabulary.to_outlines().__reduce__()
    write_entry(path, data, kind="vocab", key=key)
    return path


def _checked_vocab(path: Path, key: str) -> Path:
    stat = path.stat()
    seen = (str(path), stat.st_size, stat.st_mtime_ns)
    if seen not in _checked:
        read_entry(path, kind="vocab", key=key)
        _checked.add(seen)
    return path


class _Worker:
    """The long-lived compile process (see `compile_worker`), restarted after a kill."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        cmd = [sys.executable, "-m", "quantkit.grammar.compile_worker", str(memory)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        # Wait for "ready" outside the compile limit: on a loaded machine the interpreter
        # start-up alone has taken over 20 s.
        if self._read(_STARTUP_TIMEOUT_S) != "ready":
            self.close()
            raise GrammarError(
                f"the grammar compiler process did not start within {_STARTUP_TIMEOUT_S:g} s"
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout_s: float) -> str | None:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        return self.proc.stdout.readline().rstrip("\n")

    def request(self, payload: dict[str, str], timeout_s: float) -> str | None:
        """The answer line, or None if the time ran out (the process is then killed)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout_s)
        if answer is None:
            self.close()
        return answer

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.communicate()


_workers: dict[int, _Worker] = {}


@atexit.register
def _close_workers() -> None:
    for worker in _workers.values():
        worker.close()
    _workers.clear()


def run_worker(
    regex: str,
    vocabulary: TokenVocabulary,
    out: Path,
    *,
    key: str,
    timeout_s: float,
    memory: int,
    label: str,
    limit_s: float,
) -> None:
    """Build the index of `regex` over `vocabulary` into `out` (the cache entry for `key`) in
    the worker process, killed past `timeout_s`; every failure a GrammarError naming `label`."""
    folder = out.parent
    vocab_key = _vocab_key(vocabulary)
    vocab_path = _vocab_file(vocabulary, folder, vocab_key)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".regex", delete=False) as fh:
        fh.write(regex)
        regex_path = Path(fh.name)
    worker = _workers.get(memory)
    if worker is None or not worker.alive():
        worker = _workers[memory] = _Worker(memory)
    payload = {
        "vocab": str(vocab_path),
        "vocab_key": vocab_key,
        "regex": str(regex_path),
        "out": str(out),
        "key": key,
    }
    try:
        answer = worker.request(payload, timeout_s)
    finally:
        regex_path.unlink(missing_ok=True)
        if not out.is_file():  # killed or failed while writing: drop its half-written index
            out.with_name(f"{out.name}.tmp-{worker.proc.pid}").unlink(missing_ok=True)
    if answer is None:
        raise GrammarError(
            f"{label}: compiling the grammar took longer than the limit of {limit_s:g} s "
            f"(--compile-timeout; phase: index build); simplify the schema or raise the limit"
        )
    if answer == "ok":
        return
    if answer.startswith("rejected\t"):
        raise GrammarError(
            f"{label}: outlines-core cannot compile it: {answer.split(chr(9), 1)[1]}"
        )
    if answer == "memory" or not worker.alive():
        worker.close()
        raise GrammarError(
            f"{label}: compiling the grammar needed more than {memory / 2**30:.0f} GiB of memory "
            f"(or crashed the compiler); simplify the schema"
        )
    raise GrammarError(f"{label}: the grammar compiler failed ({answer or 'no answer'})")
