"""GGUF -> Hugging Face safetensors directory: names, q/k un-permutation, config, tokenizer.

What is family-specific comes from the family's entry (`Family.gguf`, found by the file's
`general.architecture`): the tensor-name map, the model_type written to config.json, and which
tensors llama.cpp stored permuted. For llama those are attn_q/attn_k, whose rows llama.cpp
reorders for its rotary layout; transformers' Llama expects the halves layout, so those rows
are permuted back (`unpermute_qk`). Quantized GGUF tensors are dequantized with the `gguf`
package and stored as bfloat16. The output is written into a temporary folder and renamed into
place, so a crash never leaves a directory that looks whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from quantkit.cache_manifest import write_manifest
from quantkit.errors import ModelSourceError
from quantkit.format.checkpoint import shard_groups, shard_name
from quantkit.models.families import gguf_architectures, gguf_family
from quantkit.models.family import GgufNames
from quantkit.paths import make_readable, replace_dir


def source_key(gguf_path: Path) -> str:
    """Identifies one version of a GGUF file and of this converter (the cache key).

    Size + a hash of the first and last MiB, not the whole file (hashing a multi-GB GGUF on
    every call costs seconds) and not the mtime: the same wheel installed in two virtual
    environments has two mtimes, and keying on it made each environment reconvert the model
    that the other had cached. The header (tensor names, shapes, offsets) sits in the first MiB.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        digest.update(f.read(_KEY_SPAN))
        if size > 2 * _KEY_SPAN:
            f.seek(-_KEY_SPAN, os.SEEK_END)
            digest.update(f.read(_KEY_SPAN))
    return f"size={size}:ends={digest.hexdigest()[:16]}:converter={CONVERTER_VERSION}"


_KEY_SPAN = 1 << 20


INDEX_NAME = "model.safetensors.index.json"
# Written last into a converted directory: which source it came from and with which converter.
SOURCE_MARKER = "quantkit_source.json"
# Bump when the conversion output changes, so stale cached conversions are redone.
CONVERTER_VERSION = 1
# Shards of at most 2 GiB keep peak memory during conversion to one shard, not the whole model.
MAX_SHARD_BYTES = 2 << 30

# --------------------------------------------------------------------------- GGUF


_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def family_names(architecture: str) -> GgufNames:
    """The GGUF names of the family converting `architecture`, or an error listing those that
    some family converts."""
    family = gguf_family(architecture)
    if family is None or family.gguf is None:
        raise ModelSourceError(
            f"GGUF architecture: expected one of {', '.join(gguf_architectures())}, "
            f"got {architecture!r}"
        )
    return family.gguf


def hf_tensor_name(gguf_name: str, names: GgufNames) -> str | None:
    """The transformers name of a GGUF tensor of the family with `names` (`family_names`); None
    for one with no HF counterpart. A stacked experts tensor (blk.N.ffn_gate_exps) is named with
    `{e}` where each expert's index goes: `model.layers.N.mlp.experts.{e}.gate_proj.weight`."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in names.layer:
            return f"model.layers.{layer}.{names.layer[part]}.{kind}"
        if part in names.experts and kind == "weight":
            family = gguf_family(names.architectures[0])
            assert family is not None and family.moe is not None
            block = f"model.layers.{layer}.{family.moe.block}"
            return f"{block}.experts.{{e}}.{names.experts[part]}.weight"
        return None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{names.globals[stem]}.{kind}" if stem in names.globals else None


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
    """config.json for the GGUF behind `reader` (a family with GGUF names converts it)."""
    arch = _field(reader, "general.architecture")
    family = family_names(arch)  # raises for an architecture no family converts
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
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
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
        **_moe_config(reader, arch),
    }


def _moe_config(reader: Any, arch: str) -> dict[str, Any]:
    """A mixture of experts' config.json keys (none for a dense model), under the names its
    family reads. llama.cpp's qwen3moe always renormalizes the chosen experts' weights."""
    family = gguf_family(arch)
    experts = _field(reader, f"{arch}.expert_count", None)
    if family is None or family.moe is None or experts is None:
        return {}
    moe = family.moe
    return {
        moe.experts_keys[0]: int(experts),
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
        moe.intermediate_key: int(_field(reader, f"{arch}.expert_feed_forward_length")),
        **({moe.renormalize_key: True} if moe.renormalize_key else {}),
    }


def _plan_shards(reader: Any, max_shard_bytes: int) -> list[list[Any]]:
    """Tensors grouped into shards of at most max_shard_bytes of bf16, in file order."""
    tensors = list(reader.tensors)
    sizes = [2 * int(t.n_elements) for t in tensors]
    return [[tensors[i] for i in group] for group in shard_groups(sizes, max_shard_bytes)]


def _convert_tensor(t: Any, config: dict[str, Any], names: GgufNames) -> torch.Tensor:
    from gguf.quants import dequantize

    # dequantize returns float32 in numpy order: the GGUF shape [cols, rows] reversed.
    w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
    part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    heads = names.rope_permuted.get(part)
    if heads is not None:
        w = unpermute_qk(w, config[heads])
    return w.to(torch.bfloat16)


def convert_gguf(
    gguf_path: Path,
    target: Path,
    *,
    progress: bool = True,
    key: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the GGUF at `gguf_path` as a bfloat16 HF directory at `target`, atomically.

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
    arch = _field(reader, "general.architecture")
    names = family_names(arch)
    unknown = [t.name for t in reader.tensors if hf_tensor_name(t.name, names) is None]
    unknown = [n for n in unknown if n != "rope_freqs.weight"]
    if unknown:
        raise ModelSourceError(
            f"GGUF tensors: expected dense {arch} tensors, got unsupported ones: {unknown[:5]}"
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
                fname = "model.safetensors" if len(shards) == 1 else shard_name(i + 1, len(shards))
                tensors = {}
                for t in shard:
                    name = hf_tensor_name(t.name, names)
                    if name is not None:
                        w = _convert_tensor(t, config, names)
                        # A stacked experts tensor: one HF tensor per expert.
                        parts = [(name.format(e=e), w[e].clone()) for e in range(w.shape[0])]
                        for hf, part in parts if "{e}" in name else [(name, w)]:
                            tensors[hf] = part
                            weight_map[hf] = fname
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
        marker = {"source": gguf_path.name, "key": key or source_key(gguf_path)}
        (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=2))
        write_manifest(tmp)
        make_readable(tmp)
        replace_dir(tmp, target)
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
