"""Random-weight checkpoints of real models' exact shapes, written in bounded memory.

    python -m quantkit.evals.synthetic --shape llama-3.1-8b -o DIR [--layers N] [--seed S]

Nothing here can download a model, yet memory, time and speed have to be measured at the sizes
people quantize. This writes a Hugging Face directory (config.json, bf16 safetensors shards with
their index, the embedded model's tokenizer) whose every tensor has the name and shape the real
architecture has, filled with seeded random values. Its text is noise: use it for bytes, time
and memory, never for accuracy.

The tensor list is quantkit's own decoder's (`models.decoder.CausalLM` built on the meta device
from the config), so whatever quantkit loads, this writes. Each shard's safetensors header is
computed up front and each tensor is generated and written a slab of rows at a time, so the
resident memory is one slab (64 MiB of float32) and the interpreter, whatever the model's size.
The directory is written beside its target and renamed into place at the end: a killed run
leaves no half checkpoint.

`--layers N` cuts the decoder to its first N layers (the same widths): the way to compare a
shape at two depths. The embedded tokenizer's ids (49152) fit every shape's larger vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import EvalError, QuantkitError
from quantkit.evals.common import run_main
from quantkit.format.checkpoint import shard_groups, shard_name
from quantkit.models.config import ModelConfig
from quantkit.models.decoder import CausalLM
from quantkit.paths import replace_dir, sweep_leftovers, temp_sibling

_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _llama(
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    head_dim: int,
    *,
    tied: bool,
    rope_factor: float,
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": rope_factor, **_LLAMA3_ROPE},
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
    }


def _qwen3(
    layers: int,
    *,
    moe: bool,
    hidden: int | None = None,
    inter: int | None = None,
    heads: int = 32,
    tied: bool = False,
) -> dict[str, Any]:
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": hidden or (2048 if moe else 4096),
        "intermediate_size": inter or (6144 if moe else 12288),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 4 if moe else 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
    }
    if moe:
        config.update(
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    return config


def _gemma(version: int) -> dict[str, Any]:
    """Gemma 2 2B (soft-caps, a 4096 window on every other layer) or Gemma 3 1B (q/k norms, a
    512 window on five layers of six, a local rope)."""
    common = {
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 8192 if version == 2 else 32768,
        "attention_bias": False,
        "tie_word_embeddings": True,
    }
    if version == 2:
        return {
            **common,
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 256000,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        }
    layers = 26
    return {
        **common,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "vocab_size": 262144,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 512,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
    }


# The architectures' published config.json values that decide tensor shapes (and rope).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 64, tied=True, rope_factor=32.0),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 128, tied=True, rope_factor=32.0),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 128, tied=False, rope_factor=8.0),
    "qwen3-1.7b": _qwen3(28, moe=False, hidden=2048, inter=6144, heads=16, tied=True),
    "qwen3-8b": _qwen3(36, moe=False),
    "gemma-2-2b": _gemma(2),
    "gemma-3-1b": _gemma(3),
    "qwen3-30b-a3b": _qwen3(48, moe=True),
}

SLAB_BYTES = 64 * 2**20  # float32 generated at a time: the writer's working memory
SHARD_BYTES = 2 * 10**9  # bf16 bytes per safetensors shard at most (one tensor may exceed it)
INIT_STD = 0.02  # the usual initializer range: activations stay finite through every layer
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def tensor_plan(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of `config` holds, in the decoder's order;
    a tied lm_head is the embedding and is not stored."""
    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        model = CausalLM(cfg)
    plan = [(name, tuple(p.shape)) for name, p in model.named_parameters(remove_duplicate=True)]
    if cfg.tie_word_embeddings:
        plan = [(n, s) for n, s in plan if n != "lm_head.weight"]
    return plan


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _slabs(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[bytes]:
    """The tensor's bf16 bytes, row slab by row slab: N(0, INIT_STD) for weights, ones for the
    norms (as a fresh model has them)."""
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    step = max(1, SLAB_BYTES // (4 * cols))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if _is_norm(name):
            slab = torch.ones(n, cols, dtype=torch.bfloat16)
        else:
            slab = (torch.randn(n, cols, generator=gen) * INIT_STD).to(torch.bfloat16)
        yield slab.view(torch.int16).numpy().tobytes()


def _write_shard(
    path: Path, names: list[tuple[str, tuple[int, ...]]], gen: torch.Generator, on_bytes: Any
) -> None:
    """One safetensors file: the header (known from the shapes alone), then each tensor's
    bytes as they are generated."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in names:
        nbytes = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in names:
            for chunk in _slabs(name, shape, gen):
                f.write(chunk)
                on_bytes(len(chunk))


def write_synthetic(
    config: dict[str, Any],
    out: Path,
    *,
    seed: int = 0,
    force: bool = False,
    tokenizer_dir: Path | None = None,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> dict[str, Any]:
    """Write a random-weight checkpoint of `config` to `out` (atomically); returns a summary
    (parameters, bytes, shards, seconds). `tokenizer_dir`: where the tokenizer files come from
    (default: the embedded model's)."""
    out = Path(out)
    if out.exists() and not force:
        raise EvalError(f"{out}: expected a new directory, got an existing one (--force)")
    plan = tensor_plan(config)
    groups = shard_groups([2 * math.prod(s) for _, s in plan], shard_bytes)
    total = sum(2 * math.prod(s) for _, s in plan)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path(".")).free
    if free < total * 1.05:
        raise EvalError(
            f"{out}: expected {total / 1e9:.1f} GB of free disk for the shards, got "
            f"{free / 1e9:.1f} GB"
        )
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(out)
    tmp = temp_sibling(out, "tmp")
    tmp.mkdir()
    try:
        _fill(
            tmp,
            config,
            plan,
            groups,
            seed=seed,
            tokenizer_dir=tokenizer_dir,
            total=total,
            progress=progress,
        )
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "parameters": sum(math.prod(s) for _, s in plan),
        "bytes": total,
        "shards": len(groups),
        "seconds": time.perf_counter() - started,
    }


def _fill(
    folder: Path,
    config: dict[str, Any],
    plan: list[tuple[str, tuple[int, ...]]],
    groups: list[list[int]],
    *,
    seed: int,
    tokenizer_dir: Path | None,
    total: int,
    progress: bool,
) -> None:
    from tqdm.auto import tqdm

    source = tokenizer_dir or _embedded_dir()
    ids = json.loads((source / "config.json").read_text())
    config = {
        **config,
        "torch_dtype": "bfloat16",
        **{k: ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, folder / name)
    eos = {"bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(eos, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress) as bar:
        for k, group in enumerate(groups):
            file = shard_name(k + 1, len(groups))
            _write_shard(folder / file, [plan[i] for i in group], gen, bar.update)
            weight_map.update({plan[i][0]: file for i in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _embedded_dir() -> Path:
    from quantkit.sources.resolve import resolve_model

    return resolve_model("smollm2-135m")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m quantkit.evals.synthetic", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("-o", "--output", required=True, type=Path)
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing directory")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a folder with tokenizer.json (and config.json's token ids) to copy; default: the "
        "embedded model's",
    )
    args = p.parse_args(argv)
    config = dict(SHAPES[args.shape])
    if args.layers is not None:
        if not 1 <= args.layers <= config["num_hidden_layers"]:
            p.error(f"--layers: expected 1..{config['num_hidden_layers']}, got {args.layers}")
        config.update(num_hidden_layers=args.layers, max_window_layers=args.layers)
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][: args.layers]
    try:
        done = write_synthetic(
            config, args.output, seed=args.seed, force=args.force, tokenizer_dir=args.tokenizer
        )
    except (QuantkitError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    print(
        f"wrote {args.output}: {args.shape}"
        f"{f' cut to {args.layers} layers' if args.layers else ''}, "
        f"{done['parameters'] / 1e9:.2f} B parameters, {done['bytes'] / 1e9:.2f} GB bf16 in "
        f"{done['shards']} shards, {done['seconds']:.0f} s (random weights: its text is noise)"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
