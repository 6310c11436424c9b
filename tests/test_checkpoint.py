"""Checkpoint save/load round trips, validation errors, atomic writes, and QuantLinear.

Hand-made tensors only (no model, no network): two quantized Linears with an odd out_features
(N = 20, so the zero points' last packed row is partial) and one dense embedding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.checkpoint import (
    dequantize_checkpoint_tensors,
    load_checkpoint,
    save_checkpoint,
    scheme_from_quantization_config,
    scheme_to_quantization_config,
)
from quantkit.format.fp8 import fp8_tensors
from quantkit.format.int4 import int4_tensors
from quantkit.format.packing import (
    dequantize_fp8,
    int4_dequantize,
    int4_qparams,
    int4_quantize,
    quantize_fp8,
    quantize_fp8_per_token,
)
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.reference.fp8 import fp8_linear_reference
from quantkit.runtime.quant_linear import QuantLinear

N, K = 20, 64
MODULES = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj"]
SCHEMES = {
    "int4-asym-g32": QuantScheme("int4", group_size=32),
    "int4-sym-g64": QuantScheme("int4", group_size=64, symmetric=True),
    "int4-asym-channel": QuantScheme("int4", group_size=-1),
    "fp8-w8a16": QuantScheme("fp8"),
    "fp8-w8a8": QuantScheme("fp8", activations="dynamic"),
}
TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 64}',
    "special_tokens_map.json": "{}",
    "chat_template.jinja": "{{ messages }}",
    "generation_config.json": '{"do_sample": false}',
}


@pytest.fixture(autouse=True)
def _quantkit_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture
def source_dir(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": K}))
    for name, text in TOKENIZER_FILES.items():
        (src / name).write_text(text)
    (src / "README.md").write_text("not a model file")
    return src


def make_tensors(scheme: QuantScheme, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A complete state dict: one dense embedding and MODULES quantized with `scheme` (RTN)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(32, K, generator=gen)}
    for prefix in MODULES:
        w = torch.randn(N, K, generator=gen)
        if scheme.kind == "int4":
            scale, zero = int4_qparams(w, group_size=scheme.group_size, symmetric=scheme.symmetric)
            codes = int4_quantize(w, scale, zero, group_size=scheme.group_size)
            local = int4_tensors(codes, scale, zero, dtype=torch.float32)
        else:
            local = fp8_tensors(*quantize_fp8(w), dtype=torch.float32)
        tensors.update({f"{prefix}.{k}": v for k, v in local.items()})
    return tensors


def save(out: Path, src: Path, scheme: QuantScheme, **kwargs) -> Path:
    tensors = kwargs.pop("tensors", None) or make_tensors(scheme)
    return save_checkpoint(
        out,
        source_dir=src,
        config=json.loads((src / "config.json").read_text()),
        tensors=tensors,
        scheme=scheme,
        algorithm=kwargs.pop("algorithm", "rtn"),
        quantized_modules=kwargs.pop("quantized_modules", MODULES),
        report={"perplexity": {"before": 10.0, "after": 10.5}},
        **kwargs,
    )


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (float8 has no torch.equal kernel on CPU: compare the bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def rewrite_tensors(ckpt: Path, edit) -> None:
    """Apply `edit(dict)` to the single-file checkpoint's tensors in place."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", SCHEMES)
def test_round_trip(name: str, tmp_path: Path, source_dir: Path) -> None:
    scheme = SCHEMES[name]
    tensors = make_tensors(scheme)
    out = save(tmp_path / "out", source_dir, scheme, tensors=tensors)
    loaded = load_checkpoint(out)
    assert loaded.scheme == scheme  # includes awq vs rtn, which only quantkit.json records
    assert loaded.quantized_modules == MODULES
    assert loaded.report == {"perplexity": {"before": 10.0, "after": 10.5}}
    assert set(loaded.tensors) == set(tensors)
    assert all(same(loaded.tensors[k], v) for k, v in tensors.items())
    assert loaded.config["hidden_size"] == K
    assert loaded.config["quantization_config"] == scheme_to_quantization_config(scheme)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "quantkit.json", *TOKENIZER_FILES]
    )


def test_int4_layout_on_disk(tmp_path: Path, source_dir: Path) -> None:
    loaded = load_checkpoint(save(tmp_path / "out", source_dir, SCHEMES["int4-asym-g32"]))
    local = loaded.module_tensors(MODULES[0])
    assert local["weight_packed"].dtype == torch.int32 and local["weight_packed"].shape == (N, 8)
    assert local["weight_scale"].shape == (N, 2)
    assert local["weight_zero_point"].shape == (3, 2)  # ceil(20 / 8) rows, packed along N
    assert local["weight_shape"].tolist() == [N, K]
    assert local["weight_shape"].dtype == torch.int64  # what compressed-tensors writes


def test_fp8_scale_is_n_by_1(tmp_path: Path, source_dir: Path) -> None:
    loaded = load_checkpoint(save(tmp_path / "out", source_dir, SCHEMES["fp8-w8a16"]))
    assert loaded.module_tensors(MODULES[0])["weight_scale"].shape == (N, 1)


def test_format_without_quantkit_json(tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "a", source_dir, QuantScheme("int4", group_size=32), algorithm="awq")
    assert load_checkpoint(out).algorithm == "awq"
    (out / "quantkit.json").unlink()
    loaded = load_checkpoint(out)
    # config.json says the format; the algorithm is provenance only quantkit.json knows.
    assert loaded.scheme == QuantScheme("int4", group_size=32) and loaded.report is None
    assert loaded.algorithm is None
    out = save(tmp_path / "b", source_dir, SCHEMES["fp8-w8a8"])
    (out / "quantkit.json").unlink()
    assert load_checkpoint(out).scheme == SCHEMES["fp8-w8a8"]


def test_dense_directory_loads_without_scheme(tmp_path: Path, source_dir: Path) -> None:
    save_file({"w": torch.ones(2, 3)}, str(source_dir / "model.safetensors"))
    loaded = load_checkpoint(source_dir)
    assert loaded.scheme is None and loaded.quantized_modules == []
    assert torch.equal(dequantize_checkpoint_tensors(loaded)["w"], torch.ones(2, 3))


@pytest.mark.parametrize("name", ["int4-asym-g32", "int4-sym-g64", "fp8-w8a16"])
def test_dequantize_checkpoint_tensors(name: str, tmp_path: Path, source_dir: Path) -> None:
    scheme = SCHEMES[name]
    gen = torch.Generator().manual_seed(0)
    _ = torch.randn(32, K, generator=gen)  # the embedding make_tensors draws first
    w = torch.randn(N, K, generator=gen)  # MODULES[0]'s weight
    if scheme.kind == "int4":
        scale, zero = int4_qparams(w, group_size=scheme.group_size, symmetric=scheme.symmetric)
        codes = int4_quantize(w, scale, zero, group_size=scheme.group_size)
        expected = int4_dequantize(codes, scale, zero, group_size=scheme.group_size)
    else:
        expected = dequantize_fp8(*quantize_fp8(w))
    loaded = load_checkpoint(save(tmp_path / "out", source_dir, scheme))
    dense = dequantize_checkpoint_tensors(loaded)
    assert set(dense) == {"model.embed_tokens.weight", *(f"{m}.weight" for m in MODULES)}
    assert torch.equal(dense[f"{MODULES[0]}.weight"], expected)
    # Quantization error, bounded separately from the exact comparison above.
    assert (dense[f"{MODULES[0]}.weight"] - w).norm() / w.norm() < 0.2


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", SCHEMES)
def test_quantization_config_round_trip(name: str) -> None:
    scheme = SCHEMES[name]
    cfg = scheme_to_quantization_config(scheme)
    assert cfg["quantization_status"] == "compressed" and cfg["ignore"] == ["lm_head"]
    group = cfg["config_groups"]["group_0"]
    assert group["format"] == cfg["format"]
    assert cfg["format"] == ("pack-quantized" if scheme.kind == "int4" else "float-quantized")
    back = scheme_from_quantization_config(json.loads(json.dumps(cfg)))
    assert back == scheme


def test_unresolved_scheme_cannot_be_written() -> None:
    with pytest.raises(SchemeError, match="auto"):
        scheme_to_quantization_config(QuantScheme("int4"))


def _mutate(path: str, value):
    def edit(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


BAD_CONFIGS = [
    ("quant_method", "gptq", "quant_method: expected 'compressed-tensors', got 'gptq'"),
    ("quantization_status", "frozen", "quantization_status: expected 'compressed'"),
    ("config_groups.group_0.weights.num_bits", 8, "weights.num_bits: expected 4, got 8"),
    ("config_groups.group_0.weights.group_size", 16, "weights.group_size: expected 32 or 64"),
    ("config_groups.group_0.weights.type", "nvfp", "weights.type: expected 'int' or 'float'"),
    ("config_groups.group_0.weights.strategy", "tensor", "weights.strategy: expected 'group'"),
    ("config_groups.group_0.weights.dynamic", True, "weights.dynamic: expected False, got True"),
    ("config_groups.group_0.format", "marlin-24", "format: expected the top-level format"),
    ("format", "float-quantized", "format: expected the top-level format"),
    ("config_groups.group_0.targets", ["Embedding"], "targets: expected a list with 'Linear'"),
    ("config_groups.group_0.input_activations", {"num_bits": 8}, "input_activations: expected"),
    ("config_groups", {}, "config_groups: expected exactly one group, got 0"),
    ("kv_cache_scheme", {"num_bits": 8}, "kv_cache_scheme: expected None"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_CONFIGS)
def test_bad_quantization_config(path: str, value, message: str) -> None:
    cfg = scheme_to_quantization_config(SCHEMES["int4-asym-g32"])
    _mutate(path, value)(cfg)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        scheme_from_quantization_config(cfg)


def test_bad_fp8_config() -> None:
    cfg = scheme_to_quantization_config(SCHEMES["fp8-w8a8"])
    cfg["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
    with pytest.raises(CheckpointError, match="input_activations.strategy: expected 'token'"):
        scheme_from_quantization_config(cfg)
    cfg = scheme_to_quantization_config(SCHEMES["fp8-w8a16"])
    cfg["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(CheckpointError, match="weights.num_bits: expected 8, got 4"):
        scheme_from_quantization_config(cfg)


# --------------------------------------------------------------------------- sharding


def test_sharded_checkpoint_loads_the_same(tmp_path: Path, source_dir: Path) -> None:
    scheme = SCHEMES["int4-asym-g32"]
    tensors = make_tensors(scheme)
    out = save(tmp_path / "out", source_dir, scheme, tensors=tensors, max_shard_bytes=1000)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    loaded = load_checkpoint(out)
    assert all(same(loaded.tensors[k], v) for k, v in tensors.items())
    (out / shards[-1].name).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard .*{shards[-1].name}"):
        load_checkpoint(out)


# --------------------------------------------------------------------------- validation


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"not a checkpoint: {tmp_path} has no config.json"):
        load_checkpoint(tmp_path)


def test_unparseable_config_json(tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "out", source_dir, SCHEMES["int4-sym-g64"])
    (out / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: expected valid JSON"):
        load_checkpoint(out)


def test_bad_quantization_config_in_file(tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "out", source_dir, SCHEMES["int4-sym-g64"])
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="weights.num_bits: expected 4, got 2"):
        load_checkpoint(out)


def test_unknown_format_version(tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "out", source_dir, SCHEMES["int4-sym-g64"])
    meta = json.loads((out / "quantkit.json").read_text())
    (out / "quantkit.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(CheckpointError, match="expected format_version 1 or 2, got 99"):
        load_checkpoint(out)


def test_metadata_scheme_must_agree(tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "out", source_dir, SCHEMES["int4-sym-g64"])
    meta = json.loads((out / "quantkit.json").read_text())
    meta["scheme"]["group_size"] = 128
    (out / "quantkit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="quantkit.json: expected scheme .*'group_size': 64"):
        load_checkpoint(out)


P = MODULES[1]
TENSOR_ERRORS = [
    (
        "int4-asym-g32",
        lambda t: t.pop(f"{P}.weight_zero_point"),
        f"missing tensor {P}.weight_zero_point",
    ),
    ("int4-asym-g32", lambda t: t.pop(f"{P}.weight_shape"), f"missing tensor {P}.weight_shape"),
    (
        "int4-asym-g32",
        lambda t: t.update({f"{P}.weight_scale": torch.ones(N, 3)}),
        f"tensor {P}.weight_scale: expected shape [20, 2], got [20, 3]",
    ),
    (
        "int4-asym-g32",
        lambda t: t.update({f"{P}.weight_packed": torch.zeros(N, 8, dtype=torch.int64)}),
        f"tensor {P}.weight_packed: expected dtype int32, got int64",
    ),
    (
        "int4-asym-g32",
        lambda t: t.update({f"{P}.weight_zero_point": torch.zeros(N, 2, dtype=torch.int32)}),
        f"tensor {P}.weight_zero_point: expected shape [3, 2], got [20, 2]",
    ),
    (
        "int4-asym-g32",
        lambda t: t.update({f"{P}.weight_shape": torch.tensor([N, 32])}),
        f"tensor {P}.weight_packed: expected shape [20, 4], got [20, 8]",
    ),
    (
        "int4-sym-g64",
        lambda t: t.update({f"{P}.weight_zero_point": torch.zeros(3, 1, dtype=torch.int32)}),
        f"unexpected tensor {P}.weight_zero_point",
    ),
    ("int4-sym-g64", lambda t: t.pop(f"{P}.weight_packed"), f"missing tensor {P}.weight_packed"),
    (
        "fp8-w8a16",
        lambda t: t.update({f"{P}.weight_scale": torch.ones(N)}),
        f"tensor {P}.weight_scale: expected shape [20, 1], got [20]",
    ),
    (
        "fp8-w8a16",
        lambda t: t.update({f"{P}.weight_scale": torch.ones(N, 1, dtype=torch.int32)}),
        f"tensor {P}.weight_scale: expected dtype float16 or bfloat16 or float32, got int32",
    ),
    ("fp8-w8a16", lambda t: t.pop(f"{P}.weight"), f"missing tensor {P}.weight "),
    ("fp8-w8a8", lambda t: t.pop(f"{P}.weight_scale"), f"missing tensor {P}.weight_scale"),
    (
        "fp8-w8a8",
        lambda t: t.update({f"{P}.weight_scale": torch.ones(N, 2)}),
        f"tensor {P}.weight_scale: expected shape [20, 1], got [20, 2]",
    ),
    (
        "int4-sym-g64",
        lambda t: [t.pop(k) for k in list(t) if k.startswith(P)],
        f"missing tensor {P}",
    ),
]


@pytest.mark.parametrize(("name", "edit", "message"), TENSOR_ERRORS)
def test_tensor_validation(name, edit, message, tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "out", source_dir, SCHEMES[name])
    rewrite_tensors(out, edit)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(out)


def test_save_rejects_bad_tensors_before_writing(tmp_path: Path, source_dir: Path) -> None:
    scheme = SCHEMES["int4-asym-g32"]
    tensors = make_tensors(scheme)
    del tensors[f"{MODULES[0]}.weight_scale"]
    with pytest.raises(CheckpointError, match=f"missing tensor {MODULES[0]}.weight_scale"):
        save(tmp_path / "out", source_dir, scheme, tensors=tensors)
    with pytest.raises(CheckpointError, match="holds quantized tensors but is not in"):
        save(tmp_path / "out", source_dir, scheme, quantized_modules=MODULES[:1])
    with pytest.raises(CheckpointError, match="lm_head"):  # listed, but stored dense
        save(tmp_path / "out", source_dir, scheme, quantized_modules=[*MODULES, "lm_head"])
    with pytest.raises(CheckpointError, match="is the source directory"):
        save(source_dir, source_dir, scheme, force=True)
    assert list(tmp_path.iterdir()) == [source_dir]


# --------------------------------------------------------------------------- atomic writes


def test_existing_output_needs_force(tmp_path: Path, source_dir: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError) as err:
        save(out, source_dir, SCHEMES["int4-sym-g64"])
    assert str(err.value) == f"output directory {out} exists; pass --force to replace it"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_force_replaces(tmp_path: Path, source_dir: Path) -> None:
    out = tmp_path / "out"
    save(out, source_dir, SCHEMES["fp8-w8a16"])
    (out / "stale.txt").write_text("old")
    save(out, source_dir, SCHEMES["int4-sym-g64"], force=True)
    assert not (out / "stale.txt").exists()
    assert load_checkpoint(out).scheme == SCHEMES["int4-sym-g64"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no .tmp / .old left


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_nothing(
    exc: type[BaseException],
    existing: bool,
    tmp_path: Path,
    source_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantkit.format import checkpoint

    out = tmp_path / "out"
    if existing:
        save(out, source_dir, SCHEMES["fp8-w8a16"])
    real_save = checkpoint.write_safetensors
    calls = []

    def flaky_save(filename, tensors, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the first shard is written, the second one dies
            raise exc("interrupted")
        real_save(filename, tensors, metadata=metadata)

    monkeypatch.setattr(checkpoint, "write_safetensors", flaky_save)
    with pytest.raises(exc):
        save(out, source_dir, SCHEMES["int4-asym-g32"], force=True, max_shard_bytes=2000)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out", "src"] if existing else ["src"])
    if existing:  # the previous checkpoint is untouched
        assert load_checkpoint(out).scheme == SCHEMES["fp8-w8a16"]


def test_tokenizer_files_copied(tmp_path: Path, source_dir: Path) -> None:
    out = save(tmp_path / "out", source_dir, SCHEMES["int4-sym-g64"])
    for name, text in TOKENIZER_FILES.items():
        assert (out / name).read_text() == text
    assert not (out / "README.md").exists()


# --------------------------------------------------------------------------- QuantLinear


def _dense_linear(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(K, N, bias=bias)


@pytest.mark.parametrize("name", ["int4-asym-g32", "int4-sym-g64", "int4-asym-channel"])
@pytest.mark.parametrize("m", [1, 5])
def test_quant_linear_int4_forward(name: str, m: int) -> None:
    scheme = SCHEMES[name]
    lin = _dense_linear(bias=True)
    ql = QuantLinear.from_float(lin, scheme=scheme)
    scale, zero = int4_qparams(lin.weight, group_size=scheme.group_size, symmetric=scheme.symmetric)
    codes = int4_quantize(lin.weight, scale, zero, group_size=scheme.group_size)
    w = int4_dequantize(codes, scale, zero, group_size=scheme.group_size)
    x = torch.randn(m, K)
    torch.testing.assert_close(ql(x), x @ w.T + lin.bias, atol=1e-5, rtol=1e-5)
    assert ql(x.unsqueeze(0)).shape == (1, m, N)
    dense = lin(x).detach()
    assert (ql(x) - dense).norm() / dense.norm() < 0.2  # quantization error, not equality


def test_quant_linear_uses_given_codes() -> None:
    scheme = SCHEMES["int4-asym-g32"]
    lin = _dense_linear(bias=False)
    scale, zero = int4_qparams(lin.weight, group_size=32, symmetric=False, clip_ratio=0.8)
    codes = int4_quantize(lin.weight, scale, zero, group_size=32)
    ql = QuantLinear.from_float(lin, scheme=scheme, codes=codes, scale=scale, zero=zero)
    assert all(
        same(v, ql.state_dict()[k])
        for k, v in int4_tensors(codes, scale, zero, dtype=torch.float32).items()
    )
    with pytest.raises(SchemeError, match="expected zero points"):
        QuantLinear.from_float(lin, scheme=scheme, codes=codes, scale=scale, zero=None)


@pytest.mark.parametrize("name", SCHEMES)
def test_quant_linear_state_dict_round_trip(name: str) -> None:
    scheme = SCHEMES[name]
    ql = QuantLinear.from_float(_dense_linear(bias=True), scheme=scheme)
    sd = ql.state_dict()
    local = {k.rsplit(".", 1)[-1] for k in make_tensors(scheme) if k.startswith(MODULES[0])}
    assert set(sd) == local | {"bias"}  # the checkpoint's names, exactly
    fresh = QuantLinear(K, N, scheme=scheme, bias=True, dtype=torch.float32)
    fresh.load_state_dict(sd)
    x = torch.randn(3, K)
    assert torch.equal(fresh(x), ql(x))
    assert scheme.describe() in repr(ql)


def test_quant_linear_from_tensors_validates() -> None:
    scheme = SCHEMES["int4-asym-g32"]
    local = dict(QuantLinear.from_float(_dense_linear(bias=False), scheme=scheme).state_dict())
    local["weight_scale"] = local["weight_scale"][:, :1]
    with pytest.raises(
        CheckpointError, match=r"weight_scale: expected shape \[20, 2\], got \[20, 1\]"
    ):
        QuantLinear.from_tensors(local, scheme=scheme)


def test_weight_bytes() -> None:
    ql = QuantLinear.from_float(_dense_linear(bias=False), scheme=SCHEMES["int4-asym-g32"])
    # packed 20x8 int32 + scale 20x2 fp32 + zero points 3x2 int32; weight_shape is not read.
    assert ql.weight_bytes() == 20 * 8 * 4 + 20 * 2 * 4 + 3 * 2 * 4
    ql8 = QuantLinear.from_float(_dense_linear(bias=True).half(), scheme=SCHEMES["fp8-w8a16"])
    assert ql8.weight_bytes() == 20 * 64 * 1 + 20 * 2 + 20 * 2


def test_half_keeps_fp8_weight() -> None:
    ql = QuantLinear.from_float(_dense_linear(bias=False), scheme=SCHEMES["fp8-w8a16"]).half()
    assert ql.weight.dtype == torch.float8_e4m3fn and ql.weight_scale.dtype == torch.float16
    ql4 = QuantLinear.from_float(_dense_linear(bias=False), scheme=SCHEMES["int4-sym-g64"]).half()
    assert ql4.weight_packed.dtype == torch.int32 and ql4.weight_scale.dtype == torch.float16


def test_fp8_forward_w8a16_and_w8a8() -> None:
    lin = _dense_linear(bias=False)
    w8, s = quantize_fp8(lin.weight.detach())
    x = torch.randn(4, K) * 3
    w16 = QuantLinear.from_float(lin, scheme=SCHEMES["fp8-w8a16"])
    w8a8 = QuantLinear.from_float(lin, scheme=SCHEMES["fp8-w8a8"])
    torch.testing.assert_close(w16(x), x @ dequantize_fp8(w8, s).T, atol=1e-5, rtol=1e-5)
    x8, xs = quantize_fp8_per_token(x)
    expected = (x8.float() * xs) @ dequantize_fp8(w8, s).T
    torch.testing.assert_close(w8a8(x), expected, atol=1e-4, rtol=1e-4)
    # Activation rounding changes the result, but only by fp8's relative precision.
    rel = (w8a8(x) - w16(x)).norm() / w16(x).norm()
    assert 0 < rel < 0.05
    with pytest.raises(ValueError, match="expected last dim 64"):
        fp8_linear_reference(x[:, :10], w8, s, act_dynamic=False)
