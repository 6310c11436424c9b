"""Checkpoint I/O in the compressed-tensors format, so vLLM, SGLang and transformers can serve it.

A checkpoint is an ordinary Hugging Face model directory: `config.json` with a
`quantization_config`, `*.safetensors` (sharded with `model.safetensors.index.json` when large),
the source's tokenizer files and `generation_config.json`, and `quantkit.json` (format version,
the scheme, the quantized modules and the quantizer's report). The tensors of one quantized
Linear are its format's (`quantkit.format.formats`: `int4` pack-quantized, `fp8`
float-quantized), each documented in that format's module.

Facts checked against compressed-tensors 0.20.1: its `PackedQuantizationCompressor` writes
`weight_shape = torch.tensor(weight.shape)` (int64) and unpacks the zero point with
`packed_dim=0`; `QuantizationArgs` writes `group_size: null` for the channel strategy.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import CheckpointError
from quantkit.format.compressed_tensors import (
    scheme_from_quantization_config,
    scheme_to_quantization_config,
)
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.formats import FORMATS
from quantkit.format.lazy_safetensors import (
    SafetensorsFiles,
    TensorEntry,
    read_header,
    read_tensor,
)
from quantkit.format.safetensors_writer import write_safetensors
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import check_module_tensors
from quantkit.paths import make_readable, replace_dir, sweep_leftovers, temp_sibling

__all__ = [
    "LoadedCheckpoint",
    "check_module_tensors",
    "check_output_dir",
    "dequantize_checkpoint_tensors",
    "load_checkpoint",
    "save_checkpoint",
    "scheme_from_quantization_config",
    "scheme_to_quantization_config",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
METADATA_NAME = "quantkit.json"
# Version of quantkit.json. 2 records the format (`scheme`) and the algorithm apart; 1 mixed
# them (`scheme.method` awq/rtn/fp8, `scheme.rounding`) and is still read. Others are refused.
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
# Everything a tokenizer or a chat template may need, plus the sampling defaults. Copied as they
# are when present in the source; none of them is required (logits need no tokenizer).
COPIED_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# --------------------------------------------------------------------------- save


def save_checkpoint(
    out: Path,
    *,
    source_dir: Path,
    config: dict[str, Any],
    tensors: Mapping[str, torch.Tensor],
    scheme: QuantScheme,
    algorithm: str,
    quantized_modules: list[str],
    report: dict[str, Any],
    force: bool = False,
    max_shard_bytes: int = 2**30,
) -> Path:
    """Write a compressed-tensors checkpoint to `out` atomically and return `out`.

    `tensors` is the complete state dict under HF names: dense tensors as they are and, for each
    module in `quantized_modules`, the tensors of its format's contract under
    "<module>.<local name>". Everything is written into a temporary directory beside `out` and
    renamed into place at the end, so an error or Ctrl-C never leaves a half checkpoint at `out`.
    """
    out, source_dir = Path(out), Path(source_dir)
    check_output_dir(out, force=force, source_dir=source_dir)
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes: expected a positive size, got {max_shard_bytes}")
    if not isinstance(tensors, LazyTensors):
        # A lazy source (a streamed quantization) checked each module as it finished it.
        _check_state_dict(tensors, scheme=scheme, quantized_modules=quantized_modules)
    full_config = dict(config)
    head = "lm_head" in quantized_modules
    full_config["quantization_config"] = scheme_to_quantization_config(scheme, quantized_head=head)
    if head:  # the embedding stays dense for lookups; the head is its own quantized Linear
        full_config["tie_word_embeddings"] = False
    metadata = {
        "format_version": FORMAT_VERSION,
        "scheme": scheme.to_json(),
        "algorithm": algorithm,
        "quantized_modules": list(quantized_modules),
        "report": report,
    }
    try:
        config_text = json.dumps(full_config, indent=2, sort_keys=True) + "\n"
        metadata_text = json.dumps(metadata, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config and report: expected JSON-serializable values: {e}") from e

    out.parent.mkdir(parents=True, exist_ok=True)
    for line in sweep_leftovers(out):
        warnings.warn(line, stacklevel=2)
    tmp = temp_sibling(out, "tmp")
    tmp.mkdir()
    try:
        _write_tensors(tmp, tensors, max_shard_bytes=max_shard_bytes)
        for name in COPIED_FILES:
            if (source_dir / name).is_file():
                shutil.copy2(source_dir / name, tmp / name)
        (tmp / METADATA_NAME).write_text(metadata_text)
        # config.json last: a directory with a config.json looks like a model to every tool.
        (tmp / "config.json").write_text(config_text)
        make_readable(tmp)  # safetensors writes 0600: others could not read the checkpoint
        replace_dir(tmp, out)
    except BaseException:
        # BaseException on purpose: KeyboardInterrupt must clean up too, then propagate.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_output_dir(out: Path, *, force: bool, source_dir: Path | None = None) -> None:
    """Fail early if `out` cannot be written. save_checkpoint checks it before writing anything;
    callers that quantize first should call it before quantizing, so minutes of work are not
    lost to a name clash."""
    out = Path(out)
    if out.exists() and not force:
        raise CheckpointError(f"output directory {out} exists; pass --force to replace it")
    if source_dir is not None and out.exists() and out.resolve() == Path(source_dir).resolve():
        raise CheckpointError(f"output directory {out} is the source directory; pick another")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output directory {out}: expected a directory, got a file")
    # The nearest existing folder above `out` is where the temporary directory goes.
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(
            f"output directory {out}: expected {parent} to be a directory, got a file"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"output directory {out}: {parent} is not writable")


def _check_state_dict(
    tensors: Mapping[str, torch.Tensor], *, scheme: QuantScheme, quantized_modules: list[str]
) -> None:
    """Validate the state dict before anything is written: the loader would reject it later."""
    found = _quantized_prefixes(tensors)
    wanted = set(quantized_modules)
    if not wanted:
        raise CheckpointError("quantized_modules: expected at least one module, got none")
    heads = sorted(m for m in wanted if m.rsplit(".", 1)[-1] == "lm_head" and m != "lm_head")
    if heads:
        raise CheckpointError(f"quantized_modules: expected the head as lm_head, got {heads[0]}")
    extra = sorted(found - wanted)
    if extra:
        raise CheckpointError(
            f"tensors: {extra[0]} holds quantized tensors but is not in quantized_modules"
        )
    for prefix in quantized_modules:
        check_module_tensors(_module_view(tensors, prefix), scheme=scheme, prefix=prefix)


def save_shard(shard: Mapping[str, torch.Tensor | TensorEntry], path: Path) -> None:
    """One safetensors file, written a tensor at a time (`safetensors_writer`: the same bytes
    `safetensors` writes, without its copy of every tensor); a failed write (a full disk, a
    file-size limit) is the OSError it was, naming the path."""
    write_safetensors(path, shard, metadata={"format": "pt"})


def shard_groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of consecutive items (their byte `sizes`) grouped into shards of at most `limit`
    bytes; an item larger than the limit gets a shard of its own. Every writer of shards (the
    checkpoint, the GGUF conversion, the synthetic models) groups with this."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def shard_name(i: int, count: int) -> str:
    """The file name of shard `i` (from 1) of `count`, as transformers names them."""
    return f"model-{i:05d}-of-{count:05d}.safetensors"


class LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors by name that are read when looked up, with their sizes known without reading:
    what a streamed quantization hands the checkpoint writer, so a model larger than memory
    is written one shard at a time."""

    def nbytes(self, name: str) -> int:
        raise NotImplementedError


class FileTensors(LazyTensors):
    """Named tensors of safetensors files, in a chosen order, each read when looked up."""

    def __init__(self, files: SafetensorsFiles, order: Sequence[str]) -> None:
        missing = [n for n in order if n not in files]
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]}: no staged file holds it")
        self.files, self.order = files, list(order)
        self._names = set(self.order)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self.files.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    def nbytes(self, name: str) -> int:
        return self.files.entries[name].nbytes


def _item(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | TensorEntry:
    if isinstance(tensors, FileTensors):
        return tensors.files.entries[name]
    return tensors[name]


def tensor_nbytes(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    """The bytes of one tensor of `tensors`, without reading it when it is lazy."""
    if isinstance(tensors, LazyTensors):
        return tensors.nbytes(name)
    t = tensors[name]
    return t.numel() * t.element_size()


def _write_tensors(
    directory: Path, tensors: Mapping[str, torch.Tensor], *, max_shard_bytes: int
) -> None:
    """safetensors shards of at most `max_shard_bytes` (a bigger single tensor gets its own),
    each written a tensor at a time."""
    names = list(tensors)
    sizes = [tensor_nbytes(tensors, name) for name in names]
    total = sum(sizes)
    groups = shard_groups(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        # A staged tensor is copied file to file; one in memory is written from where it is.
        shard = {names[j]: _item(tensors, names[j]) for j in group}
        fname = SINGLE_NAME if len(groups) == 1 else shard_name(i, len(groups))
        save_shard(shard, directory / fname)
        weight_map.update(dict.fromkeys(shard, fname))
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------- load


@dataclass
class LoadedCheckpoint:
    """A checkpoint read back and validated. `scheme` is None for a dense HF directory."""

    path: Path
    config: dict[str, Any]
    scheme: QuantScheme | None
    tensors: dict[str, torch.Tensor]
    quantized_modules: list[str]
    report: dict[str, Any] | None
    algorithm: str | None = None  # provenance from quantkit.json: rtn, awq or gptq

    def module_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """One module's tensors under their local names, ready for `QuantLinear.from_tensors`."""
        return _module_view(self.tensors, prefix)


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read and validate a checkpoint (or a dense HF directory) on CPU."""
    path = Path(path)
    config = _read_json(
        path / "config.json", missing=f"not a checkpoint: {path} has no config.json"
    )
    metadata = None
    if (path / METADATA_NAME).is_file():
        metadata = _read_json(path / METADATA_NAME, missing="")
        version = metadata.get("format_version")
        if version not in _READABLE_VERSIONS:
            raise CheckpointError(
                f"{path / METADATA_NAME}: expected format_version "
                f"{' or '.join(map(str, _READABLE_VERSIONS))}, got {version!r}"
            )
    tensors = _read_tensors(path)
    qcfg = config.get("quantization_config")
    if qcfg is None:
        return LoadedCheckpoint(path, config, None, tensors, [], _report(metadata))
    scheme = scheme_from_quantization_config(qcfg)
    algorithm = None
    if metadata is not None:
        recorded, algorithm = _recorded_scheme(metadata, path / METADATA_NAME)
        if recorded != scheme.to_json():
            # config.json is what other engines read, so it wins; a disagreement means hand edits.
            raise CheckpointError(
                f"{path / METADATA_NAME}: expected scheme {scheme.to_json()} (from config.json), "
                f"got {metadata.get('scheme')!r}"
            )
    found = _quantized_prefixes(tensors)
    listed = [] if metadata is None else list(metadata.get("quantized_modules", []))
    for prefix in listed:
        if prefix not in found:
            name = f"{prefix}.{scheme.format.tensor_names(scheme)[0]}"
            raise CheckpointError(
                f"missing tensor {name}: {METADATA_NAME} lists {prefix} as quantized"
            )
    if not found:
        raise CheckpointError(
            f"{path}: quantization_config says {scheme.describe()} but no tensor is quantized"
        )
    modules = sorted(found, key=_natural_key)
    for prefix in modules:
        check_module_tensors(_module_view(tensors, prefix), scheme=scheme, prefix=prefix)
    return LoadedCheckpoint(path, config, scheme, tensors, modules, _report(metadata), algorithm)


def _recorded_scheme(metadata: dict[str, Any], where: Path) -> tuple[dict[str, Any], str | None]:
    """(the scheme's fields as `QuantScheme.to_json` writes them, the algorithm) from
    quantkit.json, translating version 1 (`method` awq/rtn/fp8 + `rounding`) on the way."""
    fields = metadata.get("scheme")
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: expected a 'scheme' object, got {fields!r}")
    if metadata.get("format_version") == FORMAT_VERSION:
        return fields, metadata.get("algorithm")
    method, rounding = fields.get("method"), fields.get("rounding", "nearest")
    if method not in ("awq", "rtn", "fp8") or rounding not in ("nearest", "gptq"):
        raise CheckpointError(
            f"{where}: expected scheme.method awq/rtn/fp8 and rounding nearest/gptq (version 1), "
            f"got {method!r} and {rounding!r}"
        )
    translated = {
        "kind": "fp8" if method == "fp8" else "int4",
        "group_size": fields.get("group_size"),
        "symmetric": fields.get("symmetric"),
        "activations": fields.get("activations", "none"),
    }
    algorithm = "gptq" if rounding == "gptq" else "rtn" if method == "fp8" else method
    return translated, algorithm


def _report(metadata: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if metadata is None else metadata.get("report")


def _read_json(file: Path, *, missing: str) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(missing or f"missing file {file}")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: expected valid JSON, got a parse error: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory, through the index when there is one."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index, missing="").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty weight_map, got {weight_map!r}")
        files = sorted(set(weight_map.values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
        if not files:
            raise CheckpointError(f"not a checkpoint: {path} has no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        if not (path / fname).is_file():
            raise CheckpointError(f"missing shard {path / fname} (listed in {INDEX_NAME})")
        tensors.update(load_shard(path / fname))
    if index.is_file():
        check_index_holds(weight_map, tensors)
    return tensors


def check_index_holds(weight_map: Mapping[str, str], names: Iterable[str]) -> None:
    """Every tensor the index maps is among `names` (what its shards hold); else a
    CheckpointError naming the first missing one and the shard the index says holds it."""
    missing = sorted(set(weight_map) - set(names))
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]}: {INDEX_NAME} maps it to {weight_map[missing[0]]}, "
            f"which does not hold it"
        )


def read_weight_map(index_file: Path) -> dict[str, str]:
    """The tensor -> shard map of a sharded model's index; an unreadable one is a
    CheckpointError naming the file."""
    try:
        weight_map = json.loads(Path(index_file).read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index_file}: expected JSON with a weight_map, got an unreadable file ({e})"
        ) from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file}: expected weight_map to be an object")
    return weight_map


def load_shard(file: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors, each read into memory of its own (`read_tensor`); a
    truncated, empty or foreign file is a CheckpointError naming it (the header is checked
    against the file size before a byte of tensors is read). Not memory-mapped: a mapped
    file's touched pages stay in the resident set as long as any tensor of it lives (4.7 GB
    beside the 9.4 GB of tensors an 8B INT4 model holds after loading)."""
    return {name: read_tensor(entry) for name, entry in read_header(file).items()}


def shard_names(file: Path) -> list[str]:
    """The tensor names in one safetensors file's header, without reading any tensor; a
    damaged header is a CheckpointError naming the file."""
    return list(read_header(file))


def _quantized_prefixes(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """Modules carrying a tensor that only a quantized module of some format carries (checked
    against every format, so tensors of the wrong format are found, then refused by name)."""
    found = set()
    for name, t in tensors.items():
        prefix, _, local = name.rpartition(".")
        if prefix and any(f.marks_quantized(local, t) for f in FORMATS.values()):
            found.add(prefix)
    return found


def _module_view(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of one module under their local names ("weight_packed", ...)."""
    start = prefix + "."
    return {
        name[len(start) :]: tensors[name]
        for name in tensors
        if name.startswith(start) and "." not in name[len(start) :]
    }


def _natural_key(name: str) -> list[Any]:
    """layers.2 before layers.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


# --------------------------------------------------------------------------- dequantize


def dequantize_checkpoint_tensors(
    loaded: LoadedCheckpoint, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A dense HF state dict: every quantized module's tensors replaced by its dequantized
    `weight` (in `dtype`, default the scale's dtype). The oracle for reference comparisons."""
    dense = dict(loaded.tensors)
    if loaded.scheme is None:
        return dense
    scheme = loaded.scheme
    for prefix in loaded.quantized_modules:
        local = {k: dense.pop(f"{prefix}.{k}") for k in _module_view(loaded.tensors, prefix)}
        scale_dtype = local["weight_scale"].dtype
        # FP4 scales are float8 / uint8 codes, not the model's dtype: fp32 then.
        out_dtype = dtype or (scale_dtype if scale_dtype in SCALE_DTYPES else torch.float32)
        w = scheme.format.dequantize(local, scheme, dtype=out_dtype)
        dense[f"{prefix}.weight"] = w
        if "bias" in local:
            dense[f"{prefix}.bias"] = local["bias"]
    return dense
