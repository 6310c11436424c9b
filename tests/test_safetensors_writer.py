"""quantkit writes safetensors files itself, a tensor at a time: byte for byte what the
safetensors library writes, from tensors in memory and from tensors still in other files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantkit.format.lazy_safetensors import DTYPES, SafetensorsFiles
from quantkit.format.safetensors_writer import write_safetensors

NAMES = ["a", "b.weight", "model.layers.10.x", "model.layers.2.x", "Z", "é-unicode", 'q"uote',
         "back\\slash", "tab\there", "_", "0"]  # fmt: skip


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 8,), generator=gen)
    raw = bits.to(torch.uint8)
    size = torch.empty((), dtype=dtype).element_size()
    numel = torch.Size(shape).numel()
    t = raw[: numel * size].view(dtype) if dtype != torch.bool else raw[:numel] % 2 == 1
    return t.reshape(shape)


def _cases(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = list(DTYPES.values())
    shapes = [(), (0,), (1,), (3, 5), (2, 3, 4), (7,), (0, 4)]
    out = {}
    for i, name in enumerate(NAMES * 2):
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        shape = shapes[int(torch.randint(0, len(shapes), (1,), generator=gen))]
        out[f"{name}{i}"] = _random(dtype, shape, gen)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_same_bytes_as_the_library(tmp_path: Path, seed: int) -> None:
    tensors = _cases(seed)
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "lib.safetensors"
    ).read_bytes()
    # The same tensors copied from the file they are in: the same bytes again.
    files = SafetensorsFiles([tmp_path / "lib.safetensors"])
    write_safetensors(tmp_path / "copied.safetensors", files.entries, metadata={"format": "pt"})
    assert (tmp_path / "copied.safetensors").read_bytes() == (
        tmp_path / "lib.safetensors"
    ).read_bytes()


def test_every_header_length_pads_like_the_library(tmp_path: Path) -> None:
    for length in range(1, 17):  # names of every length mod 8
        tensors = {"n" * length: torch.zeros(2)}
        save_file(tensors, str(tmp_path / "lib"), metadata={"format": "pt"})
        write_safetensors(tmp_path / "ours", tensors, metadata={"format": "pt"})
        assert (tmp_path / "ours").read_bytes() == (tmp_path / "lib").read_bytes(), length


def test_a_failed_write_names_the_file(tmp_path: Path) -> None:
    target = tmp_path / "missing-folder" / "x.safetensors"
    with pytest.raises(OSError) as e:
        write_safetensors(target, {"a": torch.zeros(1)})
    assert e.value.filename == str(target)
