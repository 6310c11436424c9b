"""Synthetic checkpoints of real shapes (`python -m quantkit.evals.synthetic`): the shapes are
the published architectures' (parameter counts), the files are valid safetensors that quantkit
loads, the values are seeded, and a write never leaves half a directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantkit.errors import EvalError
from quantkit.evals.synthetic import SHAPES, main, tensor_plan, write_synthetic

# Published parameter counts (embeddings included, a tied head counted once), in billions.
PUBLISHED = {
    "llama-3.2-1b": 1.236,
    "llama-3.2-3b": 3.213,
    "llama-3.1-8b": 8.030,
    "qwen3-1.7b": 1.721,  # tied; the hub's files also store the head apart (2.03 B)
    "qwen3-8b": 8.191,
    "gemma-2-2b": 2.614,
    "gemma-3-1b": 1.000,
    "qwen3-30b-a3b": 30.532,
}

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": 1000,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_shapes_have_the_published_parameter_counts(shape: str) -> None:
    params = sum(math.prod(s) for _, s in tensor_plan(SHAPES[shape]))
    assert round(params / 1e9, 3) == PUBLISHED[shape]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in out.values())
    return out


def test_a_tiny_shape_is_written_loadable_and_seeded(tmp_path: Path, tiny_model_dir: Path) -> None:
    first = tmp_path / "a"
    done = write_synthetic(TINY, first, tokenizer_dir=tiny_model_dir, shard_bytes=100_000,
                           progress=False)  # fmt: skip
    tensors = _tensors(first)
    plan = dict(tensor_plan(TINY))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == plan
    assert done["shards"] > 1 and len(list(first.glob("*.safetensors"))) == done["shards"]
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    std = tensors["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.018 < std < 0.022
    assert (first / "tokenizer.json").exists()
    config = json.loads((first / "config.json").read_text())
    source = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["eos_token_id"] == source["eos_token_id"] and config["torch_dtype"] == "bfloat16"
    # The same seed gives the same bytes; another seed other values.
    again = tmp_path / "b"
    write_synthetic(TINY, again, tokenizer_dir=tiny_model_dir, shard_bytes=100_000, progress=False)
    assert all(torch.equal(t, _tensors(again)[k]) for k, t in tensors.items())
    other = tmp_path / "c"
    write_synthetic(TINY, other, seed=1, tokenizer_dir=tiny_model_dir, progress=False)
    assert not torch.equal(_tensors(other)["lm_head.weight"], tensors["lm_head.weight"])
    # quantkit loads it and runs it.
    from quantkit.runtime.loader import load_model

    loaded = load_model(first)
    logits = loaded.model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 1000) and torch.isfinite(logits).all()


def test_an_existing_directory_is_refused_and_nothing_is_left(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "m"
    out.mkdir()
    with pytest.raises(EvalError, match="expected a new directory"):
        write_synthetic(TINY, out, tokenizer_dir=tiny_model_dir, progress=False)
    assert list(tmp_path.iterdir()) == [out]


def test_a_failing_write_leaves_no_half_directory(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quantkit.evals.synthetic as synthetic

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synthetic, "_write_shard", broken)
    with pytest.raises(OSError):
        write_synthetic(TINY, tmp_path / "m", tokenizer_dir=tiny_model_dir, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_the_command_checks_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--shape", "llama-3.2-1b", "--layers", "99", "-o", "x"])
    assert e.value.code == 2 and "--layers: expected 1..16, got 99" in capsys.readouterr().err
