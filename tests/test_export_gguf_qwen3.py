"""GGUF export and import of Qwen3 and Qwen3-MoE: llama.cpp's qwen3 / qwen3moe tensor names
(per-head q/k norms, no rotary permutation, each layer's experts stacked per Linear), their
metadata, and a round trip back through quantkit's GGUF reader whose logits transformers
computes to equal the source model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.export.gguf import export_gguf
from quantkit.sources.gguf import convert_gguf
from tests.conftest import make_tokenizer, run_cli
from tests.family_models import make_family_model


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _with_tokenizer(model: Path, tokenizer: Path) -> Path:
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, model / f.name)
    return model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    model = make_family_model("qwen3", tmp_path_factory.mktemp("qwen3") / "m")
    return _with_tokenizer(model, tokenizer_dir)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    model = make_family_model("qwen3_moe", tmp_path_factory.mktemp("qwen3moe") / "m")
    return _with_tokenizer(model, tokenizer_dir)


def _fields_and_tensors(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: np.array(dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    return fields, tensors


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def _source(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def test_qwen3_is_llama_cpp_qwen3_and_round_trips(qwen3_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    export_gguf(qwen3_dir, path, int4_type="f32", progress=False)
    fields, tensors = _fields_and_tensors(path)
    source = _source(qwen3_dir)
    assert fields["general.architecture"] == "qwen3"
    assert fields["qwen3.attention.key_length"] == 32  # head_dim 32, not hidden / heads = 16
    assert fields["qwen3.block_count"] == 2
    # NEOX rope, as transformers': q/k rows as they are, no permutation.
    q = source["model.layers.1.self_attn.q_proj.weight"].numpy()
    assert np.array_equal(tensors["blk.1.attn_q.weight"], q)
    norm = source["model.layers.0.self_attn.k_norm.weight"].numpy()
    assert np.array_equal(tensors["blk.0.attn_k_norm.weight"], norm)
    back = convert_gguf(path, tmp_path / "hf", progress=False)
    config = json.loads((back / "config.json").read_text())
    assert (config["model_type"], config["head_dim"]) == ("qwen3", 32)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    # The reader writes bf16: compare against the source rounded the same way.
    rounded = tmp_path / "rounded"
    shutil.copytree(qwen3_dir, rounded)
    from safetensors.torch import save_file

    bf16 = {k: v.to(torch.bfloat16).float() for k, v in source.items()}
    save_file(bf16, rounded / "model.safetensors", metadata={"format": "pt"})
    torch.testing.assert_close(_logits(back, ids), _logits(rounded, ids), rtol=0, atol=0)


def test_qwen3_moe_experts_are_stacked_and_round_trip(moe_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    report = export_gguf(moe_dir, path, int4_type="f32", progress=False)
    fields, tensors = _fields_and_tensors(path)
    source = _source(moe_dir)
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["qwen3moe.expert_count"] == 4
    assert fields["qwen3moe.expert_used_count"] == 2
    assert fields["qwen3moe.expert_feed_forward_length"] == 64
    for part, local in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        want = np.stack(
            [source[f"model.layers.1.mlp.experts.{e}.{local}.weight"].numpy() for e in range(4)]
        )
        got = tensors[f"blk.1.ffn_{part}_exps.weight"]
        assert got.shape == want.shape and np.array_equal(got, want), part
    router = source["model.layers.0.mlp.gate.weight"].numpy()
    assert np.array_equal(tensors["blk.0.ffn_gate_inp.weight"], router)
    assert not any(".experts." in n or ".ffn_gate.weight" in n for n in tensors)
    # 2 layers x (4 attention + 2 norms + 2 q/k norms + router + 3 stacks) + embed, norm, head.
    assert report.tensors == 2 * 12 + 3
    back = convert_gguf(path, tmp_path / "hf", progress=False)
    config = json.loads((back / "config.json").read_text())
    assert config["num_experts"] == 4 and config["moe_intermediate_size"] == 64
    assert config["norm_topk_prob"] is True
    got = _source(back)
    for name, w in source.items():
        assert torch.equal(got[name], w.to(torch.bfloat16)), name
    assert set(got) == set(source)


def test_int4_experts_keep_their_codes(
    capsys: pytest.CaptureFixture[str], moe_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    from quantkit.format.checkpoint import load_checkpoint

    # bf16 weights, as real checkpoints have: their scales are bf16, which fp16 holds exactly.
    bf16 = tmp_path / "bf16"
    shutil.copytree(moe_dir, bf16)
    cast = {k: v.to(torch.bfloat16) for k, v in _source(moe_dir).items()}
    save_file(cast, bf16 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    ckpt = tmp_path / "ckpt"
    args = ("--method", "rtn", "--eval-tokens", "0", "--bits", "4", "--group-size", "32")
    code, _, err = run_cli(capsys, "quantize", str(bf16), "-o", str(ckpt), *args, "--symmetric")
    assert code == 0, err
    path = tmp_path / "m.gguf"
    report = export_gguf(ckpt, path, progress=False)
    assert report.int4_type == "q4_0" and report.exactness.exact
    _, tensors = _fields_and_tensors(path)
    loaded = load_checkpoint(ckpt)
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}.down_proj"
        w = loaded.scheme.format.dequantize(
            loaded.module_tensors(prefix), loaded.scheme, dtype=torch.float32
        )
        assert np.array_equal(tensors["blk.0.ffn_down_exps.weight"][e], w.numpy()), e


def test_moe_without_renormalized_routing_is_refused(
    capsys: pytest.CaptureFixture[str], moe_dir: Path, tmp_path: Path
) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(moe_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    out = tmp_path / "o.gguf"
    code, _, err = run_cli(capsys, "export", "gguf", str(odd), "-o", str(out), "--no-progress")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code != 0 and len(lines) == 1 and "norm_topk_prob" in lines[0], err
    assert not out.exists()


def test_peer_benchmark_counts_the_used_experts_bytes(moe_dir: Path, tmp_path: Path) -> None:
    from quantkit.evals.peers.llamacpp import gguf_read_bytes

    path = tmp_path / "m.gguf"
    export_gguf(moe_dir, path, int4_type="f32", progress=False)
    source = _source(moe_dir)
    experts = sum(w.numel() for n, w in source.items() if ".experts." in n)
    rest = sum(w.numel() for n, w in source.items() if ".experts." not in n)
    embed = source["model.embed_tokens.weight"].numel()  # not tied: decode reads one row
    assert gguf_read_bytes(path) == 4 * (rest - embed + experts * 2 / 4)  # top 2 of 4
