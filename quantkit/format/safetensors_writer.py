"""Write a safetensors file one tensor at a time, byte for byte what `safetensors` writes.

`safetensors.torch.save_file` turns every tensor of a file into a bytes object before writing,
so a 1 GiB shard costs 2 GiB of memory. Here the header is computed from names, dtypes and
shapes alone, and each tensor's bytes go to the file straight from its memory, or, for a tensor
still in another safetensors file (a staged layer), from that file to this one in the kernel
(`copy_file_range`): writing a checkpoint holds no tensor it does not already hold.

The layout is the library's (0.8), pinned by a test against `save_file`: the 8-byte length, a
compact JSON header with `__metadata__` first and then the tensors in data order, padded with
spaces to a multiple of 8; the data ordered by dtype (widest-aligned first, the library's
order) and then by name.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from quantkit.format.lazy_safetensors import DTYPES, TensorEntry

NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The data order of the safetensors library: its dtype enumeration, descending.
_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8",
          "BOOL")  # fmt: skip
_RANK = {name: i for i, name in enumerate(_ORDER)}
_COPY_CHUNK = 1 << 26

Item = torch.Tensor | TensorEntry


def write_safetensors(
    path: Path, tensors: Mapping[str, Item], *, metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` (in memory, or `TensorEntry`s of other files) to `path`."""
    items = sorted(tensors.items(), key=lambda kv: (_RANK[_dtype_name(kv[1])], kv[0]))
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, item in items:
        size = _nbytes(item)
        header[name] = {
            "dtype": _dtype_name(item),
            "shape": list(item.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for _, item in items:
                if isinstance(item, TensorEntry):
                    _copy_range(item, f)
                else:
                    f.write(_raw(item))
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def _dtype_name(item: Item) -> str:
    return NAMES[item.dtype]


def _nbytes(item: Item) -> int:
    if isinstance(item, TensorEntry):
        return item.nbytes
    return item.numel() * item.element_size()


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy when it is contiguous on the CPU."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def _copy_range(entry: TensorEntry, out) -> None:  # noqa: ANN001 - a binary file
    """Copy one tensor's bytes from its file to `out`, kernel to kernel where possible."""
    out.flush()
    dst = out.fileno()
    src = os.open(entry.file, os.O_RDONLY)
    try:
        done = 0
        while done < entry.nbytes:
            want = min(_COPY_CHUNK, entry.nbytes - done)
            try:
                n = os.copy_file_range(src, dst, want, entry.start + done)
            except (AttributeError, OSError) as e:
                if isinstance(e, OSError) and e.errno not in _NO_COPY_RANGE:
                    raise
                n = os.write(dst, os.pread(src, want, entry.start + done))
            if n <= 0:
                raise OSError(f"{entry.file}: ended inside a tensor")
            done += n
    finally:
        os.close(src)


# copy_file_range refuses some pairs of file systems or files; plain reads and writes do then.
_NO_COPY_RANGE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}
