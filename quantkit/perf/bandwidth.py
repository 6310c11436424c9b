"""This CPU's memory bandwidth: measured with a copy probe, checked, and cached with its story.

Every MBU and every decode ceiling on a CPU divides by this number, so a wrong one is wrong
everywhere: a probe taken while other processes held the cores once cached 8.1 GB/s where a
quiet run gives ~25, and every later MBU was inflated ~3x until the file was deleted by hand.
Hence:

- the probe is the best of several short rounds (noise only ever lowers a copy's speed);
- a figure outside what any CPU socket moves (`PLAUSIBLE`) is a measurement failure, never
  cached, and a cached one outside it is damage: measured again, with a warning;
- the share of the CPUs other processes used during the probe is recorded; a figure taken on a
  busy machine is re-measured at the next use until a quiet measurement replaces it (the better
  figure is kept);
- the entry records when and how it was measured (probe version, rounds, spread, load), so the
  summaries and `--json` can say it, and a new probe version or another CPU or thread count
  measures afresh. `quantkit roofline --measure` measures on demand.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from quantkit.cpu import cpu_name
from quantkit.errors import HardwareError
from quantkit.paths import atomic_file, file_lock, quantkit_home

GB = 1e9
PROBE_VERSION = 2
# Bytes/s no CPU socket is outside of: below, the probe was starved (0.58 GB/s was seen under a
# load of 10 on 2 cores); above, no DDR5/HBM CPU reaches it (12-channel DDR5 is ~600 GB/s).
PLAUSIBLE = (0.2 * GB, 2000 * GB)
ROUNDS = 5
# Share of all cores that other processes used during the probe above which it counts as busy.
BUSY_SHARE = 0.25
CACHE_NAME = "bandwidth.json"


@dataclass(frozen=True)
class BandwidthRecord:
    """One measurement of this CPU's copy bandwidth and how it was taken."""

    bytes_per_s: float
    key: str  # "<cpu name> | <n> threads"
    measured_at: str  # ISO 8601, UTC
    rounds: int
    spread: float  # fastest round / slowest round
    others_load: float | None  # share of all cores other processes used during the probe
    probe: int = PROBE_VERSION
    cached: bool = False

    @property
    def busy(self) -> bool:
        return self.others_load is not None and self.others_load > BUSY_SHARE

    def source(self) -> str:
        """One line for summaries: what, where, when, and a caution if it may be low."""
        when = self.measured_at.replace("T", " ")[:16] + " UTC"
        line = f"copy probe v{self.probe} on {self.key}: best of {self.rounds} rounds, {when}"
        if self.busy:
            line += (
                f"; other processes used {self.others_load:.0%} of the CPUs meanwhile, may be low "
                "(quantkit roofline --measure on a quiet machine)"
            )
        return line + (" (cached)" if self.cached else "")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["cached"]
        return out


def measure_copy_bandwidth(*, seconds: float = 0.1, nbytes: int = 256 * 2**20) -> float:
    """Memory bandwidth of this CPU in bytes/s from the fastest of repeated tensor copies.

    Convention (STREAM's "Copy"): a copy of S bytes reads S and writes S, and 2S / time is
    reported, the bytes the memory system moved. Decode is a read-only stream, and on the machine
    this was written on (Zen 3, 2 threads, shared) 2S/t of a copy came within 10% of a pure-read
    reduction (`x.sum()`) run beside it: 22.7 vs 22.1 GB/s under load, 45 vs 50 GB/s idle. S/t
    alone would halve the ceiling and double every MBU. `nbytes` must dwarf the last-level cache
    (256 MiB vs 32).
    """
    return max(_copy_rounds(1, seconds=seconds, nbytes=nbytes))


def _copy_rounds(rounds: int, *, seconds: float, nbytes: int) -> list[float]:
    """The best copy bandwidth of each of `rounds` rounds of `seconds`, a few ms apart (a
    neighbour's burst passes instead of being sampled inside every round)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults, not bandwidth
    moved = 2 * src.numel() * src.element_size()
    results = []
    for i in range(rounds):
        if i:
            time.sleep(0.02)
        best = math.inf
        deadline = time.perf_counter() + seconds
        reps = 0
        while reps < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
            reps += 1
        results.append(moved / best)
    return results


def probe(*, rounds: int = ROUNDS, seconds: float = 0.1) -> BandwidthRecord:
    """Measure now: the fastest of `rounds` short rounds. A result outside `PLAUSIBLE` is a
    HardwareError (not a number to divide by)."""
    before = _cpu_times()
    results = _copy_rounds(rounds, seconds=seconds, nbytes=256 * 2**20)
    load = _others_load(before, _cpu_times())
    best = max(results)
    if not PLAUSIBLE[0] <= best <= PLAUSIBLE[1]:
        raise HardwareError(
            f"CPU bandwidth probe: expected {PLAUSIBLE[0] / GB:g}-{PLAUSIBLE[1] / GB:g} GB/s, "
            f"got {best / GB:.3g} GB/s"
        )
    return BandwidthRecord(
        bytes_per_s=best,
        key=cpu_key(),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        rounds=rounds,
        spread=best / min(results),
        others_load=load,
    )


def cpu_key() -> str:
    threads = torch.get_num_threads()
    return f"{cpu_name()} | {threads} thread{'s' if threads != 1 else ''}"


def cpu_bandwidth(*, remeasure: bool = False, seconds: float = 0.1) -> BandwidthRecord:
    """This CPU's bandwidth: the cached record when it is sound, quiet and of this probe;
    otherwise measured (keeping the better of a busy cached figure and the new one) and cached.

    `remeasure` measures again in any case (the better figure is still kept: noise only lowers
    a copy's speed, and a plausible figure was once really reached)."""
    path = quantkit_home() / CACHE_NAME
    key = cpu_key()
    with _cache_lock(path) as writable:
        cache = _read_cache(path)
        entry = _valid_entry(cache.get(key), key, path)
        if entry is not None and not remeasure and not entry.busy:
            return BandwidthRecord(**{**asdict(entry), "cached": True})
        record = probe(seconds=seconds)
        if entry is not None and entry.bytes_per_s > record.bytes_per_s:
            record = BandwidthRecord(**{**asdict(entry), "others_load": record.others_load})
        cache[key] = record.to_json()
        if writable:
            _write_cache(path, cache)
    return record


@contextmanager
def _cache_lock(path: Path) -> Iterator[bool]:
    """The cache's lock; where it cannot be taken (a read-only $QUANTKIT_HOME) the probe still
    runs, the figure is used for this run, and writing it is skipped with a warning."""
    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(path.with_suffix(".lock")))
        except OSError as e:
            warnings.warn(
                f"bandwidth cache {path}: no lock ({e.strerror}); not cached", stacklevel=4
            )
            yield False
            return
        yield True


def _cpu_times() -> tuple[float, float, float] | None:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process) now; None
    where /proc/stat is not there (the load is then unknown, never guessed)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    own = os.times()
    return time.monotonic(), (sum(fields[:8]) - idle) / tick, own.user + own.system


def _others_load(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> float | None:
    """Share of all cores that processes other than this one kept busy between two readings
    (the probe's own threads are not load: a quantkit run that just decoded is not a busy
    machine, which a load average would claim)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])
    return min(max(others / ((after[0] - before[0]) * (os.cpu_count() or 1)), 0.0), 1.0)


def _read_cache(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _damaged(path, f"unreadable ({type(e).__name__})")
        return {}
    if not isinstance(data, dict):
        _damaged(path, f"expected a JSON object, got {type(data).__name__}")
        return {}
    return data


def _valid_entry(raw: Any, key: str, path: Path) -> BandwidthRecord | None:
    """The cached record for `key`, or None when there is none, it is of an older probe, or it
    is damaged (then with a warning)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        _damaged(path, f"entry {key!r}: expected an object, got {type(raw).__name__}")
        return None
    if raw.get("probe") != PROBE_VERSION:
        return None  # an older probe's figure: measured afresh, silently
    value = raw.get("bytes_per_s")
    if isinstance(value, bool) or not isinstance(value, int | float):
        _damaged(path, f"entry {key!r}: expected a number of bytes/s, got {value!r}")
        return None
    try:
        record = BandwidthRecord(**raw)
    except TypeError as e:
        _damaged(path, f"entry {key!r}: {e}")
        return None
    if not PLAUSIBLE[0] <= value <= PLAUSIBLE[1]:
        _damaged(
            path,
            f"entry {key!r}: expected {PLAUSIBLE[0] / GB:g}-{PLAUSIBLE[1] / GB:g} GB/s, "
            f"got {value / GB:.3g}",
        )
        return None
    return record


def _damaged(path: Path, why: str) -> None:
    warnings.warn(f"bandwidth cache {path}: {why}; measuring again", stacklevel=3)


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:  # a concurrent reader never sees half a file
            tmp.write_text(json.dumps(cache, indent=1) + "\n")
    except OSError as e:
        # The figure is still good for this run; only the cache is lost.
        warnings.warn(f"bandwidth cache {path}: not written ({e.strerror})", stacklevel=3)
