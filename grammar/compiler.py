"""Grammar -> a compiled grammar of one of two engines, within one time limit.

Engines (`ENGINES`; `compile_grammar(engine=...)`, the CLI's --grammar-engine). A Lark grammar
(`cfg`, context-free) goes to llguidance alone: outlines-core compiles regular languages only,
so asking for it is a GrammarError, and auto picks llguidance.

- "llguidance" (`llguidance.engine`): compiles the JSON schema itself in milliseconds; what it
  cannot represent exactly it refuses, naming the keyword, or (`llguidance.schema`) narrows with
  a note;
- "outlines": outlines-core's token index of a regex (a schema is lowered to one first, possibly
  narrowed: each narrowing is a note, shown as a warning);
- "auto", the default. The rule, from JSONSchemaBench (225 schemas, 15 categories x 15, the
  embedded model's tokenizer, 10 s limit, 2 shared vCPUs; `python -m
  quantkit.evals.grammar.jsonschema --no-generate --no-cache --compile-timeout 10`):
  llguidance compiled 78% of the schemas against outlines-core's 73%, in 1.5/7.8 ms p50/p90
  against 407/2882 ms, accepted 98% of the valid test instances against 83% (outlines-core's
  rejections are its own narrowing), both rejected every invalid one, mask fill 50 us mean
  against 56. So a JSON schema goes to llguidance first, and to outlines-core (with whatever
  time is left) only when llguidance refuses it: together 88%, 2.4 ms p50, still sound. A
  regex or a choice goes to outlines-core first (small indexes, compiled once and cached on
  disk), and to llguidance when outlines-core cannot compile it.

outlines-core, the details:

Building an Index walks every token of the vocabulary through the regex's automaton: from 10 ms
to minutes, and up to gigabytes (see `outlines.schema_regex.regex_parts`). So:

- the build runs in a child process (`compile_worker`, started once and reused) that is killed
  when `timeout_s` runs out; an allocation past `memory_limit_bytes` fails inside it; either
  becomes a GrammarError naming the cause;
- the result is cached under `$QUANTKIT_HOME/grammar/`, keyed by (regex, vocabulary
  fingerprint, outlines-core version), so a second run of the same schema loads it instead of
  compiling (the regex is derived from the schema deterministically, so it stands for both);
  the cache is trimmed to `QUANTKIT_GRAMMAR_CACHE_MB` (default 2048), oldest first;
- every entry carries a header (`cache_file`: format, the full key, payload size and SHA-256),
  so a truncated, emptied or overwritten entry, or one copied from another regex, is found
  when read: one warning line on stderr, then it is rebuilt (atomically) within the same limit;
- and kept in memory for the life of the process, so a batch or a benchmark that reuses a
  grammar pays nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.budget import CompletionPlan, byte_vocabulary, completion_plan
from quantkit.grammar.cache_file import (
    DamagedEntryError,
    cache_folder,
    entry_key,
    read_entry,
    report_damage,
    write_entry,
)
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.llguidance.engine import compile_llguidance, llg_tokenizer
from quantkit.grammar.narrowing import property_order_note
from quantkit.grammar.native_threads import run_with_limit
from quantkit.grammar.outlines.lowering import lower_schema
from quantkit.grammar.outlines.row import OutlinesRow
from quantkit.grammar.vocabulary import TokenVocabulary, import_outlines_core
from quantkit.grammar.worker_client import run_worker
from quantkit.paths import quantkit_home

__all__ = [
    "DEFAULT_ENGINE",
    "DEFAULT_TIMEOUT_S",
    "ENGINES",
    "CompiledGrammar",
    "clear_memory_cache",
    "compile_grammar",
    "grammar_cache_dir",
]

DEFAULT_TIMEOUT_S = 30.0
ENGINES = ("auto", "llguidance", "outlines")
DEFAULT_ENGINE = "auto"
DEFAULT_MEMORY_LIMIT = 6 * 2**30
# Indexes of large schemas reach 100+ MB, so only the few most recent stay in memory.
_MEMORY_ENTRIES = 4
_memory: OrderedDict[str, Any] = OrderedDict()
_plans: dict[str, CompletionPlan] = {}


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready to drive rows (`new_row`). engine: "outlines" (index: an outlines-core
    Index) or "llguidance" (index: an `LlgIndex`). source: "compiled", "disk" or "memory";
    plan: distances to completion, for finishing within the token budget (`budget`; outlines
    only). tried: the engines that refused it first, with why (auto)."""

    grammar: Grammar
    vocabulary: TokenVocabulary
    index: Any
    key: str
    compile_s: float
    source: str
    plan: CompletionPlan | None = None
    engine: str = "outlines"
    tried: tuple[str, ...] = ()

    @property
    def from_cache(self) -> bool:
        return self.source != "compiled"

    @property
    def notes(self) -> tuple[str, ...]:
        """Where the grammar is narrower than the schema (either engine: the lowering's notes,
        llguidance's warnings, the property order both fix), each a warning for the user."""
        notes = [*self.grammar.notes]
        if self.engine == "llguidance":
            notes += self.index.notes
        if self.grammar.kind == "json_schema" and self.engine != "llguidance":
            order = property_order_note(self.grammar.schema)  # llguidance's index says its own
            notes += [order] if order else []
        return tuple(notes)

    def new_row(self) -> Any:
        """A fresh matcher for one sequence (`OutlinesRow` or `llguidance.engine.LlgRow`)."""
        if self.engine == "llguidance":
            return self.index.new_row()
        return OutlinesRow(self.index)


def clear_memory_cache() -> None:
    """Forget the in-process indexes (the disk cache stays)."""
    _memory.clear()
    _plans.clear()


def grammar_cache_dir(home: Path | None = None) -> Path:
    return quantkit_home(home) / "grammar"


def _cache_key(regex: str, vocabulary: TokenVocabulary) -> str:
    """The full key of the index of `regex` over `vocabulary` (its first 32 characters name the
    file; the whole is in the entry's header)."""
    return entry_key(vocabulary.fingerprint, regex)


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


def compile_grammar(
    grammar: Grammar,
    vocabulary: TokenVocabulary,
    *,
    engine: str = DEFAULT_ENGINE,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    cache: bool = True,
    home: Path | None = None,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT,
    plan: bool = True,
    spent_s: float = 0.0,
) -> CompiledGrammar:
    """`grammar` compiled for `vocabulary` by `engine` ("auto": see the module docstring).

    timeout_s: the limit for every phase together (lowering, index build, cache load; None:
        in this process, without a limit). A run past it is a GrammarError naming the phase.
    spent_s: seconds of `timeout_s` already used by an earlier phase (a Lark grammar's syntax
        check, `cfg.load_grammar_file`): the compile gets what is left.
    cache: read and write outlines-core's disk cache (the memory cache is always used).
    plan: outlines-core only: also build the completion plan (a byte-level index of the same
        regex, see `budget`), within the same time limit.
    """
    if engine not in ENGINES:
        raise GrammarError(
            f"--grammar-engine: expected one of {', '.join(ENGINES)}, got {engine!r}"
        )
    if timeout_s is not None and not timeout_s > 0:
        raise GrammarError(f"--compile-timeout: expected a number of seconds > 0, got {timeout_s}")
    order = _engine_order(grammar, engine)
    if "llguidance" in order:  # per vocabulary, once (~0.3 s), like building the vocabulary
        llg_tokenizer(vocabulary)
    started = time.perf_counter() - spent_s
    tried: list[str] = []
    for name in order:
        left = None if timeout_s is None else timeout_s - (time.perf_counter() - started)
        if left is not None and left <= 0:
            break
        try:
            if name == "llguidance":
                index = compile_llguidance(grammar, vocabulary, timeout_s=left, limit_s=timeout_s)
                key = hashlib.sha256(index.grammar_text.encode("utf-8")).hexdigest()[:32]
                elapsed = time.perf_counter() - started
                return CompiledGrammar(
                    grammar, vocabulary, index, key, elapsed, "compiled", None, "llguidance",
                    tuple(tried),
                )  # fmt: skip
            compiled = _compile_outlines(
                grammar, vocabulary, timeout_s=left, cache=cache, home=home,
                memory_limit_bytes=memory_limit_bytes, plan=plan, limit_s=timeout_s,
            )  # fmt: skip
            elapsed = time.perf_counter() - started
            return dataclasses.replace(compiled, compile_s=elapsed, tried=tuple(tried))
        except GrammarError as e:
            if len(order) == 1:
                raise
            tried.append(f"{name}: {e}")
    raise GrammarError(
        " / ".join(tried)
        or f"{grammar.label}: no time left to compile it within the limit of {timeout_s or 0:g} s "
        f"(--compile-timeout)"
    )


def _engine_order(grammar: Grammar, engine: str) -> list[str]:
    """The engines to try, in order (see the module docstring)."""
    if grammar.kind == "lark":
        if engine == "outlines":
            raise GrammarError(
                f"--grammar-engine outlines: expected llguidance or auto for {grammar.label} "
                f"(outlines-core compiles regular expressions, not context-free grammars), "
                f"got outlines"
            )
        return ["llguidance"]
    if engine != "auto":
        return [engine]
    order = ["llguidance", "outlines"]
    if grammar.kind != "json_schema":
        order.reverse()
    return order


def _compile_outlines(
    grammar: Grammar,
    vocabulary: TokenVocabulary,
    *,
    timeout_s: float | None,
    cache: bool,
    home: Path | None,
    memory_limit_bytes: int,
    plan: bool,
    limit_s: float | None = None,
) -> CompiledGrammar:
    """The outlines-core Index of `grammar` over `vocabulary`, from memory, disk, or compiled
    now (its schema lowered first, if not yet, within the same limit)."""
    started, limit = time.perf_counter(), timeout_s
    shown = limit_s or limit  # the user's --compile-timeout, for messages
    grammar = lower_schema(grammar, timeout_s=timeout_s, limit_s=shown)
    if limit is not None:
        timeout_s = limit - (time.perf_counter() - started)
        if timeout_s <= 0:
            raise GrammarError(
                f"{grammar.label}: lowering the schema used the whole limit (--compile-timeout; "
                f"phase: lowering)"
            )
    index, key, source = _index(
        grammar, vocabulary, timeout_s=timeout_s, cache=cache, home=home,
        memory=memory_limit_bytes, limit_s=shown,
    )  # fmt: skip
    completion = None
    if plan:
        left = None if limit is None else limit - (time.perf_counter() - started)
        if left is not None and left < 0.05:  # no time for the plan: generate unsteered
            plan = False
    if plan:
        byte_index, byte_key, _ = _index(
            grammar, byte_vocabulary(), timeout_s=left, cache=cache, home=home,
            memory=memory_limit_bytes, limit_s=shown,
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
    limit_s: float | None = None,
) -> tuple[Any, str, str]:
    """(index, cache key, source) from memory, disk, or compiled now."""
    started = time.perf_counter()
    oc = import_outlines_core()
    full_key = _cache_key(grammar.regex, vocabulary)
    key = full_key[:32]
    if key in _memory:
        _memory.move_to_end(key)
        return _memory[key], key, "memory"
    folder = grammar_cache_dir(home) if cache else Path(tempfile.mkdtemp(prefix="qk-grammar-"))
    cache_folder(folder)
    entry = _Entry(
        oc, grammar, vocabulary, folder / f"{key}.index", full_key, started, timeout_s, memory,
        limit_s or timeout_s,
    )  # fmt: skip
    try:
        index, source = _from_disk_or_built(entry)
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


@dataclass(frozen=True)
class _Entry:
    """One index to load from the disk cache or build: where, for what (`key`: the full cache
    key, checked against the entry's header), and the time limit that started at `started`."""

    oc: Any
    grammar: Grammar
    vocabulary: TokenVocabulary
    path: Path
    key: str
    started: float
    timeout_s: float | None
    memory: int
    limit_s: float | None

    def left(self) -> float | None:
        if self.timeout_s is None:
            return None
        return self.timeout_s - (time.perf_counter() - self.started)

    def build(self) -> None:
        """Compile the index into `path` (in this process without a limit, else in the worker)."""
        left = self.left()
        if left is None:
            _compile_here(self.oc, self.grammar, self.vocabulary, self.path, key=self.key)
            return
        if left <= 0:  # reading a damaged entry used the rest of the limit
            raise GrammarError(
                f"{self.grammar.label}: no time left to rebuild its damaged cache entry within "
                f"the limit of {self.limit_s or 0:g} s (--compile-timeout; phase: index build)"
            )
        run_worker(
            self.grammar.regex, self.vocabulary, self.path, key=self.key, timeout_s=left,
            memory=self.memory, label=self.grammar.label, limit_s=self.limit_s or left,
        )  # fmt: skip

    def load(self) -> Any:
        return _load_index(
            self.oc, self.path, key=self.key, timeout_s=self.left(), label=self.grammar.label
        )


def _from_disk_or_built(entry: _Entry) -> tuple[Any, str]:
    """(index, source): the cached entry, or built now when there is none; a damaged entry is
    reported in one line and rebuilt (its replacement goes in by rename, see `cache_file`)."""
    source = "disk"
    if not entry.path.is_file():
        source = "compiled"
        entry.build()
    try:
        index = entry.load()
    except DamagedEntryError as damage:
        if source == "compiled":  # unreadable as soon as built: rebuilding would not help
            raise
        report_damage(damage)
        entry.path.unlink(missing_ok=True)
        entry.build()
        index, source = entry.load(), "compiled"
    entry.path.touch()  # most recently used: trimmed last
    return index, source


def _load_index(oc: Any, path: Path, *, key: str, timeout_s: float | None, label: str) -> Any:
    """Read and check an index file within what is left of the limit (a 300 MB index takes
    seconds); DamagedEntryError if it is not the whole index for `key`. The read runs in a
    thread the caller stops waiting for at the limit; the wait returns on time only as far as
    outlines-core's native load lets the interpreter run (not measured on an index large
    enough to tell)."""
    if timeout_s is None:
        return _read_index(oc, path, key)
    done, index = run_with_limit(
        lambda: _read_index(oc, path, key), timeout_s, name="quantkit-index-load"
    )
    if not done:
        raise GrammarError(
            f"{label}: loading the cached index took longer than the limit (--compile-timeout; "
            f"phase: cache load)"
        )
    return index


def _read_index(oc: Any, path: Path, key: str) -> Any:
    payload = read_entry(path, kind="index", key=key)
    try:
        return oc.Index.from_binary(payload)
    except ValueError as e:  # a whole payload outlines-core cannot read: rebuilt all the same
        raise DamagedEntryError(path, f"outlines-core cannot read its payload: {e}") from None


def _compile_here(
    oc: Any, grammar: Grammar, vocabulary: TokenVocabulary, path: Path, *, key: str
) -> None:
    try:
        index = oc.Index(grammar.regex, vocabulary.to_outlines())
    except ValueError as e:
        raise GrammarError(f"{grammar.label}: outlines-core cannot compile it: {e}") from None
    _, (data,) = index.__reduce__()
    write_entry(path, data, kind="index", key=key)
