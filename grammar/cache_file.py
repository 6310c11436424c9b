"""One entry of the grammar cache ($QUANTKIT_HOME/grammar) on disk: a header line that says what
the entry is and how to tell that it is whole, then the payload.

    QKGRAMMAR <format> <kind> <key> <size> <sha256>\\n<payload>

kind: "index" (an outlines-core Index) or "vocab" (an outlines-core Vocabulary); key: the full
SHA-256 of what the entry was built for (regex, vocabulary fingerprint, outlines-core version),
so an entry copied from another regex or vocabulary is told apart from the right one; size and
sha256: the payload's. A reader that finds anything else (a truncated, emptied or overwritten
file, another entry's bytes) gets `DamagedEntryError` saying why, and the caller rebuilds the entry.

Writes go to a temporary file beside the entry (`NAME.tmp-PID`, what the cache's trim sweeps
when a writer was killed), are flushed to disk, then renamed over the entry: a reader sees the
old entry, no entry, or the whole new one.

Imports only the standard library and `quantkit.errors`: the compile worker reads and writes
entries with it without importing the rest of quantkit.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from quantkit.errors import GrammarError

__all__ = [
    "CacheFolderError",
    "DamagedEntryError",
    "cache_folder",
    "entry_key",
    "read_entry",
    "report_damage",
    "verify_entry",
    "write_entry",
]

MAGIC = "QKGRAMMAR"
FORMAT = 1
_MAX_HEADER = 512


class DamagedEntryError(GrammarError):
    """A cache entry that is not the whole, right entry (the caller rebuilds it)."""

    exit_code = 3

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"grammar cache: {path} is damaged ({why})")
        self.path, self.why = path, why


class CacheFolderError(GrammarError):
    """The cache folder's path holds something else (a file): the machine, not the input."""

    exit_code = 4


def cache_folder(folder: Path) -> Path:
    """`folder`, created if missing; CacheFolderError if a file stands where it should be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (folder, *folder.parents) if p.exists()), folder)
        raise CacheFolderError(
            f"grammar cache: expected a folder at {folder}, got a file at {blocker} "
            f"(move it, or point $QUANTKIT_HOME elsewhere)"
        ) from None
    return folder


def outlines_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outlines-core")
    except PackageNotFoundError:
        return "unknown"


def entry_key(*parts: str) -> str:
    """The full key (SHA-256, hex) of an entry built from `parts`. The cache format and
    outlines-core's version are part of it, so an entry of an older format or another version
    is never read (its file name differs): it ages out of the cache instead."""
    text = "\0".join((f"format{FORMAT}", outlines_version(), *parts))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _header(kind: str, key: str, payload: bytes) -> bytes:
    digest = hashlib.sha256(payload).hexdigest()
    return f"{MAGIC} {FORMAT} {kind} {key} {len(payload)} {digest}\n".encode("ascii")


def write_entry(path: Path, payload: bytes, *, kind: str, key: str) -> None:
    """Write `payload` as the `kind` entry for `key` at `path`, atomically (temp file, fsync,
    rename)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(_header(kind, key, payload))
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every file system can sync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_entry(path: Path, *, kind: str, key: str) -> bytes:
    """The payload of the `kind` entry for `key` at `path`; DamagedEntryError if it is not whole or
    was built for something else."""
    return verify_entry(path, path.read_bytes(), kind=kind, key=key)


def verify_entry(path: Path, data: bytes, *, kind: str, key: str) -> bytes:
    """`data` (the bytes of `path`) checked against its header: its payload, or
    DamagedEntryError."""
    if not data:
        raise DamagedEntryError(path, "expected a header and a payload, got an empty file")
    end = data.find(b"\n", 0, _MAX_HEADER)
    if end < 0 and data.startswith(MAGIC.encode()):
        raise DamagedEntryError(path, f"expected a whole header line, got {len(data)} bytes")
    fields = _fields(data[:end]) if end > 0 else None
    if fields is None:
        raise DamagedEntryError(path, f"expected a {MAGIC} header, got {_shown(data)}")
    got_format, got_kind, got_key, size, digest = fields
    if got_format != str(FORMAT):
        raise DamagedEntryError(path, f"expected format {FORMAT}, got format {got_format}")
    if got_kind != kind:
        raise DamagedEntryError(path, f"expected a {kind} entry, got a {got_kind} entry")
    if got_key != key:
        raise DamagedEntryError(
            path, f"expected an entry built for key {key[:12]}..., got one for {got_key[:12]}..."
        )
    payload = data[end + 1 :]
    if len(payload) != size:
        raise DamagedEntryError(path, f"expected {size} payload bytes, got {len(payload)}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise DamagedEntryError(path, "expected the payload's SHA-256 in the header, got another")
    return payload


def _fields(line: bytes) -> tuple[str, str, str, int, str] | None:
    """(format, kind, key, size, sha256) of a header line, or None if it is not one."""
    try:
        parts = line.decode("ascii").split(" ")
    except UnicodeDecodeError:
        return None
    if len(parts) != 6 or parts[0] != MAGIC or not parts[4].isdigit():
        return None
    return parts[1], parts[2], parts[3], int(parts[4]), parts[5]


def _shown(data: bytes) -> str:
    head = data[:16]
    return f"{len(data)} bytes starting {head!r}"


def report_damage(damage: DamagedEntryError) -> None:
    """The one warning line for a damaged entry about to be rebuilt (on stderr)."""
    try:
        print(f"{damage}; rebuilding", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # no stderr: the rebuild goes ahead all the same
