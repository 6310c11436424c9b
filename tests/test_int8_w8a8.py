"""INT8 W8A8 (compressed-tensors `int-quantized`): the format, the exact emulation and the VNNI
C kernel.

- The format: per-channel int8 weights, W8A8 only, reached with `--format int8` (`--bits 8`
  stays fp8); its config entries are compressed-tensors' W8A8 preset, both ways; its tensors
  round-trip through the checkpoint.
- The reference (`reference.int8`) sums the integer products exactly: held to an int64 matmul
  at the int32 limits, and its per-token quantization to `int8_absmax`.
- The C kernel (`cpu.int8`, AVX512-VNNI only: skipped elsewhere) is the reference bit for bit
  over odd shapes (K not a multiple of 4, N not of 16, M from 1 to past a prefill chunk), bias
  and bf16 activations; a CPU without VNNI falls back to the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import quantkit.fused_kernels.cpu.int8 as ic
from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.checkpoint import (
    dequantize_checkpoint_tensors,
    load_checkpoint,
    save_checkpoint,
)
from quantkit.format.compressed_tensors import (
    scheme_from_quantization_config,
    scheme_to_quantization_config,
)
from quantkit.format.formats import format_for_bits
from quantkit.format.packing import int8_absmax
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels import kernel_registry
from quantkit.fused_kernels.kernel_registry import choose_kernel
from quantkit.fused_kernels.reference.int8 import int8_linear_reference, int8_matmul_exact
from quantkit.runtime.quant_linear import QuantLinear

SCHEME = QuantScheme("int8")
needs_vnni = pytest.mark.skipif(
    not ic.int8_cpu_available(), reason="the W8A8 C kernel needs a CPU with AVX512-VNNI"
)


@pytest.fixture(scope="module", autouse=True)
def kernel_home(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("QUANTKIT_HOME", str(tmp_path_factory.mktemp("quantkit-home")))
    mp.delenv("QUANTKIT_BACKEND", raising=False)
    ic._library.cache_clear()
    yield
    ic._library.cache_clear()
    mp.undo()


# --------------------------------------------------------------------------- the format


def test_scheme_is_w8a8_per_channel_and_named_by_format_only() -> None:
    assert (SCHEME.group_size, SCHEME.symmetric, SCHEME.activations) == (-1, True, "dynamic")
    assert QuantScheme("int8", activations="none") == SCHEME  # fixed, as fp8's group size
    assert SCHEME.bits == 8 and format_for_bits(8).kind == "fp8"
    assert (
        SCHEME.describe("smoothquant") == "int8 per-channel (W8A8 dynamic per-token, smoothquant)"
    )
    with pytest.raises(SchemeError, match="int8 uses one scale per output channel"):
        QuantScheme("int8", 64)


def test_config_entries_are_the_w8a8_preset_both_ways() -> None:
    qc = pytest.importorskip("compressed_tensors.quantization")
    cfg = scheme_to_quantization_config(SCHEME)
    assert cfg["format"] == "int-quantized"
    parsed = qc.QuantizationConfig.model_validate(cfg)  # the parser vLLM and transformers use
    group = parsed.config_groups["group_0"]
    preset = qc.preset_name_to_scheme("W8A8", ["Linear"])
    assert group.weights == preset.weights
    assert group.input_activations == preset.input_activations
    assert scheme_from_quantization_config(cfg) == SCHEME
    # And what compressed-tensors itself writes for the preset reads back as int8.
    written = qc.QuantizationConfig(
        config_groups={"group_0": preset},
        format="int-quantized",
        quantization_status=qc.QuantizationStatus.COMPRESSED,
    )
    assert scheme_from_quantization_config(written.model_dump(mode="json")) == SCHEME


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda g: g.update(input_activations=None), "input_activations: expected the dynamic"),
        (lambda g: g["input_activations"].update(strategy="tensor"), "strategy: expected 'token'"),
        (lambda g: g["input_activations"].update(dynamic=False), "dynamic: expected True"),
        (lambda g: g["weights"].update(strategy="group"), "strategy: expected 'channel'"),
        (lambda g: g["weights"].update(num_bits=4), "weights.num_bits: expected 8, got 4"),
        (lambda g: g["weights"].update(symmetric=False), "symmetric: expected True"),
    ],
)
def test_config_that_is_not_w8a8_int8_is_refused(edit, message: str) -> None:
    cfg = scheme_to_quantization_config(SCHEME)
    edit(cfg["config_groups"]["group_0"])
    with pytest.raises(CheckpointError, match=message):
        scheme_from_quantization_config(cfg)


def test_round_trip_through_the_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    layer = QuantLinear.from_float(w, scheme=SCHEME, dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (48, 1)
    assert int(layer.weight.abs().max()) == 127  # each row's absmax is a code
    state = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in layer.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.randn(8, 64)
    source = tmp_path / "src"
    source.mkdir()
    out = save_checkpoint(
        tmp_path / "ckpt",
        tensors=state,
        config={"model_type": "llama"},
        scheme=SCHEME,
        quantized_modules=["model.layers.0.mlp.down_proj"],
        source_dir=source,
        algorithm="smoothquant",
        report={},
    )
    loaded = load_checkpoint(out)
    assert (loaded.scheme, loaded.algorithm) == (SCHEME, "smoothquant")
    assert torch.equal(loaded.tensors["model.layers.0.mlp.down_proj.weight"], layer.weight)
    dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)[
        "model.layers.0.mlp.down_proj.weight"
    ]
    # Half a step, plus what the bf16 scale (within 2^-9 of absmax / 127) moves code 127 by.
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((dense - w).abs() <= step * (0.5 + 127 * 2**-9)).all()


def test_contract_is_checked() -> None:
    bad = {"weight": torch.zeros(4, 8, dtype=torch.uint8), "weight_scale": torch.ones(4, 1)}
    with pytest.raises(CheckpointError, match="tensor weight: expected dtype int8, got uint8"):
        QuantLinear.from_tensors(bad, scheme=SCHEME)
    bad = {"weight": torch.zeros(4, 8, dtype=torch.int8), "weight_scale": torch.ones(4, 8)}
    with pytest.raises(CheckpointError, match=r"weight_scale: expected shape \[4, 1\]"):
        QuantLinear.from_tensors(bad, scheme=SCHEME)


# --------------------------------------------------------------------------- the emulation


def test_integer_accumulation_is_exact_at_the_limits() -> None:
    """Every product at its largest (127 x -128), K long enough that fp32 could not hold the
    sums (K * 16256 > 2^24), against an int64 matmul."""
    gen = torch.Generator().manual_seed(1)
    k = 4099
    xq = torch.randint(-127, 128, (6, k), generator=gen, dtype=torch.int8)
    wq = torch.randint(-128, 128, (21, k), generator=gen, dtype=torch.int8)
    xq[0], wq[0] = 127, -128  # the extreme sum: -127 * 128 * K
    xq[1, ::2], xq[1, 1::2] = 127, -127
    acc = int8_matmul_exact(xq, wq)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), xq.long() @ wq.long().T)
    assert int(acc[0, 0]) == -127 * 128 * k


def test_reference_is_the_integer_formula() -> None:
    """y = float(acc) * sx * sw (+ bias), acc the exact integer sum of the per-token codes."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 96, generator=gen) * 3
    x[0, 0] = 0  # an all-zero token: scale 0, output 0 (+ bias)
    w = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)
    sw = torch.rand(40, 1, generator=gen).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen)
    y = int8_linear_reference(x, w, sw, bias=bias)
    xq, sx = int8_absmax(x.reshape(-1, 96))
    acc = xq.long() @ w.long().T
    expected = (acc.double().float() * sx * sw.float().reshape(1, 40) + bias).reshape(2, 5, 40)
    assert torch.equal(y, expected)
    assert torch.equal(y[0, 0], bias)
    # The activation rounding is the only error against the float product of the same weights.
    dense = x @ (w.float() * sw.float()).T + bias
    assert 0 < (y - dense).abs().max() < 0.02 * dense.abs().max()


def test_quant_linear_runs_the_emulation() -> None:
    torch.manual_seed(3)
    w, x = torch.randn(33, 70), torch.randn(4, 70)
    layer = QuantLinear.from_float(w, scheme=SCHEME, dtype=torch.float32)
    expected = int8_linear_reference(x, layer.weight, layer.weight_scale)
    assert torch.equal(layer(x), expected)


# --------------------------------------------------------------------------- the C kernel


@needs_vnni
def test_c_quantization_is_int8_absmax() -> None:
    """Per-token codes and scales bit for bit: ties at .5 steps, a zero row, K % 16 != 0."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 37, generator=gen)
    x[0] = 0
    x[1, :5] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5])  # scale 1: ties round to even
    x[2] = torch.linspace(-1e-3, 1e-3, 37)
    codes, scale = ic.quantize_tokens_cpu(x)
    want_codes, want_scale = int8_absmax(x)
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert codes[1, :5].tolist() == [127, 0, 2, -2, 64]


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 67])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (70, 33), (3, 17), (576, 200)])
def test_c_kernel_is_the_reference_bit_for_bit(m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen) * 4
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    sw = torch.rand(n, 1, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen) if m % 2 else None
    got = ic.int8_linear_cpu(x, w, sw, bias=bias)
    assert torch.equal(got, int8_linear_reference(x, w, sw, bias=bias))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_kernel_with_half_activations_and_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 128, generator=gen).to(dtype)
    w = torch.randint(-127, 128, (80, 128), generator=gen, dtype=torch.int8)
    sw = (torch.rand(80, 1, generator=gen) * 0.02).to(dtype)
    layer = ic.CpuInt8Layer(w, sw)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (3, 4, 80)
    assert torch.equal(got, int8_linear_reference(x, w, sw))


@needs_vnni
def test_registry_picks_the_c_kernel_and_prepared_layers_use_it() -> None:
    assert choose_kernel(SCHEME, "cpu").name == "cpu-int8"
    torch.manual_seed(6)
    layer = QuantLinear.from_float(torch.randn(50, 64), scheme=SCHEME, dtype=torch.bfloat16)
    x = torch.randn(9, 64)
    assert layer._prepared().kernel == "cpu-int8"
    assert torch.equal(layer(x), int8_linear_reference(x, layer.weight, layer.weight_scale))


def test_no_vnni_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_registry, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    with pytest.warns(RuntimeWarning, match="needs a CPU with AVX512-VNNI"):
        kernel = choose_kernel(SCHEME, "cpu", "cpu")
    assert kernel.name == "reference-int8"
    with pytest.warns(RuntimeWarning, match="using reference"):
        assert choose_kernel(SCHEME, "cpu").name == "reference-int8"
