"""Read safetensors files one tensor at a time, into ordinary memory.

The quantizer streams models far larger than the machine's RAM: it needs one decoder layer's
tensors at a time and must be able to say, before reading a byte of weights, what every file
holds. `safe_open` memory-maps the file, and every page it touches then counts in the process's
resident set until the handle closes; here each tensor is read with `pread` into a buffer of its
own, so resident memory is exactly the tensors alive. Headers are parsed and checked against the
file size up front (a truncated copy fails at once, naming the file).

The layout (safetensors' format): an 8-byte little-endian header length, a JSON header mapping
each name to its dtype, shape and [start, end) byte offsets into the data that follows, and an
optional "__metadata__" entry.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A header longer than this is not a model's (safetensors itself refuses above 100 MB).
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def damaged(file: Path, why: object) -> CheckpointError:
    """The one error for a safetensors file that cannot be read as one."""
    return CheckpointError(
        f"{file}: expected a complete safetensors file, got a damaged one ({why}); a truncated "
        f"or interrupted copy? copy or download it again"
    )


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry in `file`, checked against the file's size (nothing else read)."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise damaged(file, f"{size} bytes, shorter than a header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise damaged(file, f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise damaged(file, e) from e
    if not isinstance(header, dict):
        raise damaged(file, "the header is not a JSON object")
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(file, name, info, base, size)
    return entries


def _entry(file: Path, name: str, info: object, base: int, size: int) -> TensorEntry:
    try:
        dtype = DTYPES[info["dtype"]]  # type: ignore[index]
        shape = tuple(int(d) for d in info["shape"])  # type: ignore[index]
        start, end = (int(o) for o in info["data_offsets"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as e:
        raise damaged(file, f"tensor {name}: unreadable entry {info!r:.80}") from e
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if end - start != numel * itemsize or start < 0 or base + end > size:
        raise damaged(file, f"tensor {name} lies at bytes {start}-{end} of a {size}-byte file")
    return TensorEntry(file, dtype, shape, base + start, base + end)


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor, read into a buffer of its own (no mapping of the file stays behind)."""
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    done = 0
    try:
        fd = os.open(entry.file, os.O_RDONLY)
    except OSError as e:
        raise damaged(entry.file, e) from e
    try:
        while done < entry.nbytes:
            n = os.preadv(fd, [view[done:]], entry.start + done)
            if n <= 0:
                raise damaged(entry.file, f"it ended inside a tensor at byte {entry.start + done}")
            done += n
    finally:
        os.close(fd)
    return buf.view(entry.dtype).reshape(entry.shape)


class SafetensorsFiles:
    """Tensors by name across several safetensors files, read one at a time on demand."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            self.entries.update(read_header(Path(file)))

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> torch.Tensor:
        return read_tensor(self.entries[name])
