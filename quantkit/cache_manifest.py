"""A manifest for the cached model directories under `$QUANTKIT_HOME` (a converted GGUF, the
embedded model's INT4 checkpoint): what tells a whole entry from a damaged one.

A cache is not the user's data: a truncated, emptied or overwritten file in it must be found
before it is loaded, and the entry made again with one warning line. `write_manifest` records,
in the finished temporary directory before it is renamed into place, every file's size, stat
time and SHA-256. `manifest_damage` checks an entry: a missing file or a different size is
damage at once; a file whose size and modification time are as recorded is taken as written
(no hashing on every run: 0.1 s for the 114 MB embedded checkpoint); one touched since is
hashed and compared. A directory without a manifest was made by an older quantkit: it is
adopted (`adopt_manifest`), as it was trusted before, and checked from then on.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

MANIFEST_NAME = "quantkit_manifest.json"
FORMAT = 1


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _record(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(path)}


def write_manifest(folder: Path) -> None:
    """Record every file of `folder` (the manifest itself aside) in its manifest."""
    files = {
        p.name: _record(p)
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    text = json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n"
    (Path(folder) / MANIFEST_NAME).write_text(text)


def has_manifest(folder: Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def adopt_manifest(folder: Path) -> None:
    """Give a directory an older quantkit made (no manifest) one, so it is checked from now on;
    a cache folder that cannot be written keeps working without."""
    try:
        write_manifest(folder)
    except OSError:
        pass


def manifest_damage(folder: Path) -> str | None:
    """Why the entry at `folder` is damaged, in words for a warning line; None if it is whole
    (or has no manifest: see `has_manifest`)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
            return f"expected a format-{FORMAT} manifest listing files, got another"
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    for name, want in files.items():
        path = folder / name
        try:
            st = path.stat()
        except OSError:
            return f"{name} is missing"
        if st.st_size != want.get("size"):
            return f"{name}: expected {want.get('size')} bytes, got {st.st_size}"
        if st.st_mtime_ns != want.get("mtime_ns") and _sha256(path) != want.get("sha256"):
            return f"{name}: its SHA-256 differs from the one recorded when it was written"
    return None


def is_whole(folder: Path) -> bool:
    """The fast check before the entry's lock: a manifest, and nothing in it damaged."""
    return has_manifest(folder) and manifest_damage(folder) is None


def whole_or_warned(folder: Path, *, what: str, redo: str) -> bool:
    """For an entry that exists, checked under its lock: True if it is whole (one without a
    manifest is adopted); else one warning line, `WHAT FOLDER: damaged (WHY); REDO`, and False
    (the caller makes it again)."""
    damage = manifest_damage(folder)
    if damage is None:
        if not has_manifest(folder):
            adopt_manifest(folder)  # made by an older quantkit
        return True
    warnings.warn(f"{what} {folder}: damaged ({damage}); {redo}", stacklevel=3)
    return False
