"""GGUF export: INT4 codes into llama.cpp's Q4_0/Q4_1 blocks as chosen (read back with the `gguf`
package's own dequantizer), the metadata and tokenizer llama.cpp reads, a round trip through
quantkit's GGUF reader, and one clear line for every export GGUF cannot hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.export import gguf_blocks
from quantkit.export.gguf import export_gguf, permute_qk
from quantkit.format.checkpoint import load_checkpoint
from quantkit.sources.gguf import convert_gguf, unpermute_qk
from tests.conftest import make_hf_model, make_tokenizer, run_cli

HEADS = {"attn_q": 4, "attn_k": 2}


@pytest.fixture(scope="module")
def bf16_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model stored in bfloat16, as real checkpoints are: its scales are bf16 too, which
    fp16 holds exactly."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("bf16") / "model"
    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return out


@pytest.fixture(scope="module")
def sym_ckpt(bf16_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sym") / "ckpt"
    return _export_ready(bf16_model, out, "--bits", "4", "--group-size", "32", "--symmetric")


@pytest.fixture(scope="module")
def asym_ckpt(bf16_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("asym") / "ckpt"
    return _export_ready(bf16_model, out, "--bits", "4", "--group-size", "64")


def _export_ready(model: Path, out: Path, *extra: str) -> Path:
    from quantkit.cli.main import main

    try:
        main(
            [
                "quantize",
                str(model),
                "--method",
                "rtn",
                "--eval-tokens",
                "0",
                "-o",
                str(out),
                *extra,
            ]
        )
    except SystemExit as e:
        assert not e.code, e.code
    return out


def _gguf_weights(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (GGML type, float32 weights in HF row order) read with gguf's own dequantizer."""
    import gguf
    from gguf.quants import dequantize

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if part in HEADS:
            w = unpermute_qk(w, HEADS[part])
        out[t.name] = (t.tensor_type.name, w)
    return out


def _checkpoint_linears(ckpt: Path) -> dict[str, torch.Tensor]:
    loaded = load_checkpoint(ckpt)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    out = {}
    for prefix in loaded.quantized_modules:
        layer, module = prefix.removeprefix("model.layers.").split(".", 1)
        w = loaded.scheme.format.dequantize(
            loaded.module_tensors(prefix), loaded.scheme, dtype=torch.float32
        )
        out[f"blk.{layer}.{names[module]}.weight"] = w
    return out


def test_symmetric_codes_are_q4_0_blocks_bit_for_bit(sym_ckpt: Path, tmp_path: Path) -> None:
    report = export_gguf(sym_ckpt, tmp_path / "m.gguf", progress=False)
    assert report.int4_type == "q4_0" and report.exactness.exact
    got = _gguf_weights(tmp_path / "m.gguf")
    want = _checkpoint_linears(sym_ckpt)
    assert len(want) == 14
    for name, w in want.items():
        kind, back = got[name]
        assert kind == "Q4_0"
        assert torch.equal(back, w), name


def test_asymmetric_codes_are_q4_1_within_the_fp16_min(asym_ckpt: Path, tmp_path: Path) -> None:
    report = export_gguf(asym_ckpt, tmp_path / "m.gguf", progress=False)
    assert report.int4_type == "q4_1" and report.exactness.scales_rounded == 0
    assert 0 < report.exactness.max_step_error < 0.01  # m rounded to fp16, a tiny part of a step
    loaded = load_checkpoint(asym_ckpt)
    got = _gguf_weights(tmp_path / "m.gguf")
    for name, w in _checkpoint_linears(asym_ckpt).items():
        kind, back = got[name]
        assert kind == "Q4_1"
        step = 2 * w.abs().amax() / 15  # the largest group scale there can be
        assert (back - w).abs().max() <= 0.01 * step, name
    assert loaded.scheme.group_size == 64  # two Q4_1 blocks per group, same scale


def test_mxfp4_codes_are_ggml_mxfp4_blocks_bit_for_bit(bf16_model: Path, tmp_path: Path) -> None:
    ckpt = _export_ready(bf16_model, tmp_path / "c", "--format", "mxfp4")
    report = export_gguf(ckpt, tmp_path / "m.gguf", progress=False)
    assert report.int4_type == "mxfp4" and report.exactness.exact
    got = _gguf_weights(tmp_path / "m.gguf")
    for name, w in _checkpoint_linears(ckpt).items():
        kind, back = got[name]
        assert kind == "MXFP4"
        assert torch.equal(back, w), name


def test_fp32_scales_are_rounded_to_fp16_and_said(tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = _export_ready(tiny_model_dir, tmp_path / "c", "--bits", "4", "--symmetric")
    report = export_gguf(ckpt, tmp_path / "m.gguf", progress=False)
    e = report.exactness
    assert e.scales_rounded > 0 and 0 < e.max_step_error < 0.01
    assert "near-lossless" in report.summary()
    for name, w in _checkpoint_linears(ckpt).items():
        back = _gguf_weights(tmp_path / "m.gguf")[name][1]
        assert (back - w).abs().max() <= 0.01 * w.abs().max() / 7, name


def test_metadata_and_tokenizer_are_what_llama_cpp_reads(
    sym_ckpt: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import gguf
    from transformers import AutoTokenizer

    path = tmp_path / "m.gguf"
    export_gguf(sym_ckpt, path, progress=False)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == config["num_hidden_layers"]
    assert fields["llama.embedding_length"] == config["hidden_size"]
    assert fields["llama.attention.head_count"] == 4
    assert fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == config["hidden_size"] // 4
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)  # TINY_LLAMA's theta
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == config["vocab_size"]
    assert all(tokens[i] == t for i, t in by_id.items())
    assert fields["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # the special tokens: control
    assert len(fields["tokenizer.ggml.merges"]) == len(spec["model"]["merges"])
    assert fields["tokenizer.ggml.eos_token_id"] == config["eos_token_id"]
    text = "Beautiful is better than ugly. 2024 <|im_start|>user"
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    ours = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert back(text).input_ids == ours(text).input_ids


def test_round_trip_through_quantkit_gguf_reader(sym_ckpt: Path, tmp_path: Path) -> None:
    export_gguf(sym_ckpt, tmp_path / "m.gguf", progress=False)
    back = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    from safetensors.torch import load_file

    tensors = load_file(back / "model.safetensors")
    loaded = load_checkpoint(sym_ckpt)
    for prefix in loaded.quantized_modules:
        w = loaded.scheme.format.dequantize(
            loaded.module_tensors(prefix), loaded.scheme, dtype=torch.float32
        )
        assert torch.equal(tensors[f"{prefix}.weight"], w.to(torch.bfloat16)), prefix
    embed = loaded.tensors["model.embed_tokens.weight"]
    assert torch.equal(tensors["model.embed_tokens.weight"], embed.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_dense_model_exports_as_asked(tiny_model_dir: Path, tmp_path: Path, kind: str) -> None:
    from safetensors.torch import load_file

    report = export_gguf(tiny_model_dir, tmp_path / "m.gguf", int4_type=kind, progress=False)
    assert report.int4_type is None
    got = _gguf_weights(tmp_path / "m.gguf")
    source = load_file(tiny_model_dir / "model.safetensors")
    w = source["model.layers.1.self_attn.q_proj.weight"]
    dtype, back = got["blk.1.attn_q.weight"]
    assert dtype == kind.upper()
    assert got["blk.1.attn_norm.weight"][0] == "F32"
    if kind == "q8_0":
        assert (back - w).abs().max() <= w.abs().max() / 127
    else:
        cast = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind]
        assert torch.equal(back, w.to(cast).float())


def test_permute_qk_inverts_the_readers_unpermute() -> None:
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    back = unpermute_qk(torch.from_numpy(permute_qk(w, 3)), 3).numpy()
    assert np.array_equal(back, w)
    assert not np.array_equal(permute_qk(w, 3), w)


def test_llama3_rope_becomes_rope_freqs(tmp_path: Path) -> None:
    import gguf

    from quantkit.models.rope import Rope, rope_for

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = make_tokenizer(make_hf_model(tmp_path / "m", {"hidden_size": 64, "rope_scaling": rope}))
    export_gguf(model, tmp_path / "m.gguf", int4_type="f32", progress=False)
    t = {x.name: x for x in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    freqs = torch.from_numpy(np.array(t["rope_freqs.weight"].data))
    config = json.loads((model / "config.json").read_text())
    scaled = rope_for(config, "full_attention")
    want = Rope(scaled.theta).inv_freq(16) / scaled.inv_freq(16)
    assert torch.allclose(freqs, want)
    assert freqs.max() == pytest.approx(8.0)


def test_an_interrupted_export_leaves_no_file(
    sym_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = gguf_blocks.int4_blocks
    monkeypatch.setattr("quantkit.export.gguf.int4_blocks", boom)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(sym_ckpt, tmp_path / "m.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_exports_are_one_line_each(
    capsys, tiny_model_dir: Path, sym_ckpt: Path, asym_ckpt: Path, tmp_path: Path
) -> None:
    fp8 = _export_ready(tiny_model_dir, tmp_path / "fp8", "--bits", "8")
    qwen = tmp_path / "qwen"
    shutil.copytree(tiny_model_dir, qwen)
    cfg = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_dir, odd)
    spec = json.loads((odd / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (odd / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "taken.gguf").write_bytes(b"x")
    capsys.readouterr()  # the quantize progress bars above
    out = str(tmp_path / "o.gguf")
    cases = [
        ((str(fp8), "-o", out), "no block type holding fp8"),
        ((str(asym_ckpt), "-o", out, "--type", "q4_0"), "q4_0 holds symmetric codes"),
        ((str(sym_ckpt), "-o", out, "--type", "q4_k"), "K-quant"),
        ((str(sym_ckpt), "-o", out, "--type", "f16"), "export as q4_0 or q4_1"),
        ((str(tiny_model_dir), "-o", out, "--type", "q4_0"), "the checkpoint is dense"),
        ((str(qwen), "-o", out, "--type", "f16"), "llama.cpp tensor names"),
        ((str(odd), "-o", out, "--type", "f16"), "--pre-tokenizer"),
        ((str(sym_ckpt), "-o", str(tmp_path / "m.bin")), "ending in .gguf"),
        ((str(sym_ckpt), "-o", str(tmp_path / "taken.gguf")), "--force"),
    ]
    for args, words in cases:
        code, _, err = run_cli(capsys, "export", "gguf", *args, "--no-progress")
        assert code != 0, args
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and words in lines[0], (args, err)
        assert "Traceback" not in err
    assert not (tmp_path / "o.gguf").exists()
    # The odd tokenizer exports once its pre-tokenizer is named.
    code, out_text, err = run_cli(
        capsys,
        "export",
        "gguf",
        str(odd),
        "-o",
        out,
        "--type",
        "f16",
        "--pre-tokenizer",
        "gpt-2",
        "--no-progress",
    )
    assert code == 0, err
    assert "pre-tokenizer gpt-2" in out_text
