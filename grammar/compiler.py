"""Grammar -> outlines-core Index, with a time limit and a cache on disk and in memory.

Building an Index walks every token of the vocabulary through the regex's automaton: from 10 ms
to minutes, and up to gigabytes (see `regex_parts`). So:

- the build runs in a child process (`compile_worker`, started once and reused) that is killed
  when `timeout_s` runs out; an allocation past `memory_limit_bytes` fails inside it; either
  becomes a GrammarError naming the cause;
- the result is cached under `$QUANTKIT_HOME/grammar/`, keyed by (regex, vocabulary
  fingerprint, outlines-core version), so a second run of the same schema loads it instead of
  compiling (the regex is derived from the schema deterministically, so it stands for both);
  the cache is trimmed to `QUANTKIT_GRAMMAR_CACHE_MB` (default 2048), oldest first;
- and kept in memory for the life of the process, so a batch or a benchmark that reuses a
  grammar pays nothing.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.budget import CompletionPlan, byte_vocabulary, completion_plan
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.vocabulary import TokenVocabulary, import_outlines_core
from quantkit.paths import quantkit_home

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CompiledGrammar",
    "clear_memory_cache",
    "compile_grammar",
    "grammar_cache_dir",
]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MEMORY_LIMIT = 6 * 2**30
# Indexes of large schemas reach 100+ MB, so only the few most recent stay in memory.
_MEMORY_ENTRIES = 4
_STARTUP_TIMEOUT_S = 300.0
_memory: OrderedDict[str, Any] = OrderedDict()
_plans: dict[str, CompletionPlan] = {}


@dataclass(frozen=True)
class CompiledGrammar:
    """An Index ready to drive `Guide`s. source: "compiled", "disk" or "memory" (of the token
    index); plan: distances to completion, for finishing within the token budget (`budget`)."""

    grammar: Grammar
    vocabulary: TokenVocabulary
    index: Any
    key: str
    compile_s: float
    source: str
    plan: CompletionPlan | None = None

    @property
    def from_cache(self) -> bool:
        return self.source != "compiled"


def clear_memory_cache() -> None:
    """Forget the in-process indexes (the disk cache stays)."""
    _memory.clear()
    _plans.clear()


def grammar_cache_dir(home: Path | None = None) -> Path:
    return quantkit_home(home) / "grammar"


def _outlines_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outlines-core")
    except PackageNotFoundError:
        return "unknown"


def _cache_key(regex: str, vocabulary: TokenVocabulary) -> str:
    text = f"{_outlines_version()}\0{vocabulary.fingerprint}\0{regex}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


# A `*.tmp-PID` file older than this is a leftover of a killed writer (writing one takes seconds).
_STALE_TMP_S = 600.0


def _trim(cache_dir: Path) -> None:
    # Leftovers first: a compile killed at its limit while writing its index leaves a temporary
    # file (measured: 340 and 620 MB ones) that no key points to and the size limit never saw.
    now = time.time()
    for tmp in cache_dir.glob("*.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
        except OSError:  # another process removed or renamed it meanwhile
            pass
    limit = float(os.environ.get("QUANTKIT_GRAMMAR_CACHE_MB", "2048")) * 2**20
    files = [p for p in cache_dir.glob("*.index") if p.is_file()]
    stats = {p: p.stat() for p in files}
    total = sum(s.st_size for s in stats.values())
    for path in sorted(files, key=lambda p: stats[p].st_mtime):
        if total <= limit:
            break
        total -= stats[path].st_size
        path.unlink(missing_ok=True)


def _vocab_file(vocabulary: TokenVocabulary, folder: Path) -> Path:
    path = folder / f"vocab-{vocabulary.fingerprint}.bin"
    if not path.is_file():
        _, (data,) = vocabulary.to_outlines().__reduce__()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
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


def _run_worker(
    regex: str, vocabulary: TokenVocabulary, out: Path, *, timeout_s: float, memory: int, label: str
) -> None:
    folder = out.parent
    vocab_path = _vocab_file(vocabulary, folder)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".regex", delete=False) as fh:
        fh.write(regex)
        regex_path = Path(fh.name)
    worker = _workers.get(memory)
    if worker is None or not worker.alive():
        worker = _workers[memory] = _Worker(memory)
    payload = {"vocab": str(vocab_path), "regex": str(regex_path), "out": str(out)}
    try:
        answer = worker.request(payload, timeout_s)
    finally:
        regex_path.unlink(missing_ok=True)
        if not out.is_file():  # killed or failed while writing: drop its half-written index
            out.with_name(f"{out.name}.tmp-{worker.proc.pid}").unlink(missing_ok=True)
    if answer is None:
        raise GrammarError(
            f"{label}: compiling the grammar took longer than the limit of {timeout_s:g} s "
            f"(--compile-timeout); simplify the schema or raise the limit"
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


def compile_grammar(
    grammar: Grammar,
    vocabulary: TokenVocabulary,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    cache: bool = True,
    home: Path | None = None,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT,
    plan: bool = True,
) -> CompiledGrammar:
    """The Index of `grammar` over `vocabulary`, from memory, disk, or compiled now.

    timeout_s: the compile time limit (None: compile in this process, without a limit).
    cache: read and write the disk cache (the memory cache is always used).
    plan: also build the completion plan (a byte-level index of the same regex, see `budget`),
        within the same time limit.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise GrammarError(f"--compile-timeout: expected a number of seconds > 0, got {timeout_s}")
    started = time.perf_counter()
    index, key, source = _index(
        grammar, vocabulary, timeout_s=timeout_s, cache=cache, home=home, memory=memory_limit_bytes
    )
    completion = None
    if plan:
        left = None if timeout_s is None else max(timeout_s - (time.perf_counter() - started), 1.0)
        byte_index, byte_key, _ = _index(
            grammar, byte_vocabulary(), timeout_s=left, cache=cache, home=home,
            memory=memory_limit_bytes,
        )  # fmt: skip
        completion = _plans.get(byte_key)
        if completion is None:
            completion = _plans[byte_key] = completion_plan(byte_index)
            while len(_plans) > _MEMORY_ENTRIES:
                _plans.pop(next(iter(_plans)))
    elapsed = time.perf_counter() - started
    return CompiledGrammar(grammar, vocabulary, index, key, elapsed, source, completion)


def _index(
    grammar: Grammar,
    vocabulary: TokenVocabulary,
    *,
    timeout_s: float | None,
    cache: bool,
    home: Path | None,
    memory: int,
) -> tuple[Any, str, str]:
    """(index, cache key, source) from memory, disk, or compiled now."""
    oc = import_outlines_core()
    key = _cache_key(grammar.regex, vocabulary)
    if key in _memory:
        _memory.move_to_end(key)
        return _memory[key], key, "memory"
    folder = grammar_cache_dir(home) if cache else Path(tempfile.mkdtemp(prefix="qk-grammar-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.index"
    source = "disk"
    try:
        if not path.is_file():
            source = "compiled"
            if timeout_s is None:
                _compile_here(oc, grammar, vocabulary, path)
            else:
                _run_worker(
                    grammar.regex, vocabulary, path, timeout_s=timeout_s, memory=memory,
                    label=grammar.label,
                )  # fmt: skip
        index = oc.Index.from_binary(path.read_bytes())
        path.touch()  # most recently used: trimmed last
    finally:
        if not cache:
            for leftover in folder.iterdir():
                leftover.unlink()
            folder.rmdir()
    if cache and source == "compiled":
        _trim(folder)
    _memory[key] = index
    while len(_memory) > _MEMORY_ENTRIES:
        _memory.popitem(last=False)
    return index, key, source


def _compile_here(oc: Any, grammar: Grammar, vocabulary: TokenVocabulary, path: Path) -> None:
    try:
        index = oc.Index(grammar.regex, vocabulary.to_outlines())
    except ValueError as e:
        raise GrammarError(f"{grammar.label}: outlines-core cannot compile it: {e}") from None
    _, (data,) = index.__reduce__()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
