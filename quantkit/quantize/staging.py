"""The staging directory of a streamed quantization: finished layers on disk, and a manifest
that lets a killed run continue where it stopped.

`<output>.partial/` beside the output holds:

- `manifest.json`: what the run is (the fingerprint: model files, format, algorithm, settings,
  a hash of the calibration tokens) and, per finished decoder layer, the names of its tensors in
  checkpoint order and its report; written atomically after each layer's files are on disk.
- `layer-00007.safetensors`: one finished layer's tensors (dense in the storage dtype, and its
  quantized Linears' checkpoint tensors); `outer-embed.safetensors`, `outer-norm...` and
  `outer-head...`: the embedding, final norm and head once the layers are done, one file each
  (one of them in memory at a time).
- `activations-00007.safetensors`: for a calibrated algorithm, the activations leaving the last
  finished layer (fp32, exactly as computed), so a resumed run feeds the next layer the same
  input an uninterrupted run would have: the checkpoint is bit-identical either way.

Every file is written to a temporary name, flushed to disk and renamed, then the manifest; so a
layer the manifest lists is whole, and anything else is work to redo. A second run of the same
command resumes; a different command (or changed input files) is refused, naming the difference;
`--restart` removes the directory first. A lock file keeps two runs out of one directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import torch

from quantkit.errors import CheckpointError
from quantkit.format.checkpoint import save_shard
from quantkit.format.lazy_safetensors import SafetensorsFiles, read_header
from quantkit.paths import atomic_file

MANIFEST = "manifest.json"
STAGING_VERSION = 1


def staging_dir(out: Path) -> Path:
    """Where the run writing checkpoint `out` keeps its finished layers."""
    return out.with_name(out.name + ".partial")


def layer_file(index: int) -> str:
    return f"layer-{index:05d}.safetensors"


def outer_file(part: str) -> str:
    return f"outer-{part}.safetensors"


def activations_file(index: int) -> str:
    """The activations leaving layer `index` (the input of layer index + 1)."""
    return f"activations-{index:05d}.safetensors"


class Staging:
    """One run's staging directory (see the module docstring). `open()` before use."""

    def __init__(self, path: Path, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.layers: dict[int, dict[str, Any]] = {}  # index -> {"names": [...], "report": {...}}
        self.outer: dict[str, list[str]] = {}  # part ("embed", "norm", "head") -> names
        self._lock: TextIO | None = None

    # ----------------------------------------------------------------------- open / resume

    def open(self, *, restart: bool = False) -> int:
        """Take the directory (made if missing, emptied with `restart`); returns the number of
        finished layers a previous run of the same command left (0 for a fresh start)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._take_lock()  # first: --restart must not empty a directory another run writes
        try:
            return self._resume(restart)
        except BaseException:
            self.close()  # a refused directory is not held
            raise

    def _resume(self, restart: bool) -> int:
        if restart:
            for entry in self.path.iterdir():
                if entry.name != ".lock":
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        manifest_file = self.path / MANIFEST
        if not manifest_file.is_file():
            self._write_manifest()
            return 0
        manifest = self._read_manifest(manifest_file)
        self._check_same_run(manifest.get("fingerprint", {}))
        self.layers = {int(k): v for k, v in manifest.get("layers", {}).items()}
        self.outer = dict(manifest.get("outer") or {})
        done = 0
        while done in self.layers and (self.path / layer_file(done)).is_file():
            done += 1
        # Anything after the first gap is redone (it was computed from layers now redone).
        self.layers = {i: v for i, v in self.layers.items() if i < done}
        return done

    def _take_lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        fh = open(self.path / ".lock", "a")  # noqa: SIM115 - held for the whole run
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            fh.close()
            raise CheckpointError(
                f"{self.path}: another quantize run is writing this staging directory; wait "
                f"for it or pick another output"
            ) from e
        self._lock = fh

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _read_manifest(self, file: Path) -> dict[str, Any]:
        try:
            manifest = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{file}: expected a readable manifest, got {e}; pass --restart to start over"
            ) from e
        if not isinstance(manifest, dict) or manifest.get("version") != STAGING_VERSION:
            raise CheckpointError(
                f"{file}: expected staging version {STAGING_VERSION}; pass --restart to start over"
            )
        return manifest

    def _check_same_run(self, before: Mapping[str, Any]) -> None:
        """A staging directory is resumed only by the run that made it: same input, same
        settings. The first field that differs is named."""
        for key in sorted(set(before) | set(self.fingerprint)):
            was, now = before.get(key), self.fingerprint.get(key)
            if was != now:
                raise CheckpointError(
                    f"{self.path}: left by an interrupted run with a different {key} "
                    f"({_short(was)} there, {_short(now)} now); run that command again to "
                    f"resume it, or pass --restart to start over"
                )

    # ----------------------------------------------------------------------- write

    def save_layer(
        self,
        index: int,
        tensors: dict[str, torch.Tensor],
        report: dict[str, Any],
        activations: torch.Tensor | None,
    ) -> None:
        """Layer `index` is finished: its tensors (in checkpoint order), its report and the
        activations leaving it, made durable in that order, then listed in the manifest."""
        _durable_save(tensors, self.path / layer_file(index))
        if activations is not None:
            _durable_save({"x": activations.contiguous()}, self.path / activations_file(index))
        self.layers[index] = {"names": list(tensors), "report": report}
        self._write_manifest()
        # Only the newest activations are ever read again.
        (self.path / activations_file(index - 1)).unlink(missing_ok=True)

    def save_outer(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        """One of the tensors outside the decoder layers (`part`: embed, norm, head) is done."""
        _durable_save(tensors, self.path / outer_file(part))
        self.outer[part] = list(tensors)
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {
            "version": STAGING_VERSION,
            "fingerprint": self.fingerprint,
            "layers": {str(i): v for i, v in sorted(self.layers.items())},
            "outer": self.outer,
        }
        with atomic_file(self.path / MANIFEST) as tmp:
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())

    # ----------------------------------------------------------------------- read back

    def activations(self) -> torch.Tensor:
        """The activations leaving the last finished layer (for the next one's calibration)."""
        file = self.path / activations_file(len(self.layers) - 1)
        try:
            return SafetensorsFiles([file]).read("x")
        except (CheckpointError, KeyError) as e:
            raise CheckpointError(
                f"{file}: expected the activations of layer {len(self.layers) - 1}, got {e}; "
                f"pass --restart to start over"
            ) from e

    def files(self) -> SafetensorsFiles:
        """Every staged tensor, readable one at a time."""
        names = [layer_file(i) for i in sorted(self.layers)]
        names += [outer_file(part) for part in self.outer]
        return SafetensorsFiles(self.path / n for n in names)

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _durable_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write a safetensors file under a temporary name, flush it to disk, rename it."""
    with atomic_file(path) as tmp:
        save_shard(tensors, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    read_header(path)  # what was written reads back


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
