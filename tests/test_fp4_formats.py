"""NVFP4 and MXFP4: the math bit for bit against their definitions (tests/fp4_reference.py), the
scheme and config entries, the tensor contract, QuantLinear on the reference kernel, RTN and
GPTQ through `quantkit quantize`, and every bad input as one typed error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.errors import CheckpointError, KernelUnavailableError, SchemeError
from quantkit.format import formats
from quantkit.format.compressed_tensors import (
    scheme_from_quantization_config,
    scheme_to_quantization_config,
)
from quantkit.format.fp4 import e2m1_codes, e2m1_values, pack_fp4, unpack_fp4
from quantkit.format.mxfp4 import MXFP4
from quantkit.format.nvfp4 import NVFP4, nvfp4_fake_quantize, nvfp4_global_scale
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import check_module_tensors
from quantkit.fused_kernels.kernel_registry import KERNELS, choose_kernel
from quantkit.quantize.choice import choose_scheme
from quantkit.runtime.quant_linear import QuantLinear
from tests import fp4_reference as ref
from tests.conftest import make_hf_model, make_tokenizer, run_cli

NV, MX = QuantScheme("nvfp4"), QuantScheme("mxfp4")
W4A4 = QuantScheme("nvfp4", activations="dynamic")


# --------------------------------------------------------------------------- test tensors


def _rows(groups: list[list[float]], per_row: int) -> torch.Tensor:
    """fp32 [len(groups) / per_row, per_row * G] from groups of G values each."""
    flat = [x for g in groups for x in g]
    return torch.tensor(flat, dtype=torch.float32).reshape(len(groups) // per_row, -1)


def _pad(values: list[float], size: int) -> list[float]:
    return (values + [0.0] * size)[:size]


MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def random_weight(seed: int) -> torch.Tensor:
    """Random normals with outliers, a zero group, a row 1e-6 of the rest (group scales that
    underflow E4M3), fp32 subnormals and a -0.0."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 128, generator=gen) * 0.02
    w[1, 7], w[2, 70], w[5, 3] = 3.7, -2.9, 0.4
    w[3, 32:64] = 0.0
    w[4] *= 1e-6
    w[6, :32] = torch.randn(32, generator=gen) * 1e-39  # fp32 subnormals
    w[7, 0] = -0.0
    return w


def nvfp4_ties() -> torch.Tensor:
    """g = 1 exactly (absmax 2688), then groups on exact E2M1 midpoints (scales 1 and 2), on E4M3
    midpoints (6 * 1.0625 -> 1.0, 6 * 1.1875 -> 1.25), on E4M3 subnormals (2^-8, the tie 1.5 *
    2^-9 -> 2^-8, the tie 2^-10 -> 0 -> 0.125) and past 6 (clipped)."""
    ties = [6.0, *MIDPOINTS, *[-m for m in MIDPOINTS], -0.1]
    groups = [
        _pad([2688.0, 1.0, -3.0], 16),
        ties,
        [2 * x for x in ties],
        _pad([6 * 1.0625, 1.0, 0.53125], 16),
        _pad([6 * 1.1875, -7.0, 3.0], 16),
        _pad([6 * 2.0**-8, 2.0**-8, 2.5 * 2.0**-8], 16),
        _pad([6 * 1.5 * 2.0**-9, 1e-3], 16),
        _pad([6 * 2.0**-10, -1e-3], 16),
    ]
    return _rows(groups, per_row=4)


def mxfp4_ties() -> torch.Tensor:
    """Groups of 32 on exact midpoints (X = 2^-3), past 6 (7.5 X clips), absmax just under the
    next power of two (1.99 * 4 X), fp32 subnormals (X clamps at 2^-127) and huge values."""
    x = 2.0**-3
    midpoints = [m * x for m in MIDPOINTS] + [-m * x for m in MIDPOINTS]
    groups = [
        _pad([4 * x, *midpoints, -0.0, -0.01 * x], 32),
        _pad([7.5 * x, 6.5 * x, -6.9 * x, *midpoints], 32),
        _pad([7.96 * x, 3.0 * x, 0.26 * x], 32),
        _pad([2.0**-130, -(2.0**-131), 3 * 2.0**-133], 32),
        _pad([2.0**-124, 2.0**-126], 32),
        _pad([3e38, -1e38, 1e30], 32),
    ]
    return _rows(groups, per_row=2)


def _lists(w: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v in row] for row in w]


def _assert_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (so -0.0 differs from 0.0, and NaNs would show)."""
    width = {1: torch.uint8, 4: torch.int32}[got.element_size()]
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert torch.equal(got.view(width), want.view(width)), name


# --------------------------------------------------------------------------- E2M1


def test_e2m1_grid_ties_saturation_and_sign() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e30, -0.1, -0.0, -6.0])
    want = [0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 0, 15]
    assert e2m1_codes(x).tolist() == want
    assert e2m1_codes(x).tolist() == [ref.e2m1_code(float(v)) for v in x]
    assert e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == [
        *ref.E2M1,
        *[-v for v in ref.E2M1],
    ]


def test_pack_order_and_round_trip() -> None:
    codes = torch.randint(0, 16, (5, 38), generator=torch.Generator().manual_seed(0))
    codes = codes.to(torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == ref.pack(codes.tolist())
    assert torch.equal(unpack_fp4(packed), codes)
    # Element 0 in the low nibble: codes (1, 15) -> 0xF1.
    assert pack_fp4(torch.tensor([[1, 15]], dtype=torch.uint8)).tolist() == [[0xF1]]


# --------------------------------------------------------------------------- bit for bit


@pytest.mark.parametrize(
    "weight",
    [random_weight(0), random_weight(1) * 1e4, random_weight(2)[:, :64] * 1e-30, nvfp4_ties()],
    ids=["normal", "large", "tiny", "ties"],
)
def test_nvfp4_matches_its_definition(weight: torch.Tensor) -> None:
    want = ref.nvfp4(_lists(weight))
    got = NVFP4.round_and_store(weight, NV, dtype=torch.float32)
    assert got.keys() == {"weight_packed", "weight_scale", "weight_global_scale"}
    _assert_bits("global", got["weight_global_scale"], torch.tensor([want["global"]]))
    scales = torch.tensor(want["scales"]).to(torch.float8_e4m3fn)
    assert torch.equal(scales.float(), torch.tensor(want["scales"]))  # the reference is E4M3
    _assert_bits("weight_scale", got["weight_scale"], scales)
    packed = torch.tensor(ref.pack(want["codes"]), dtype=torch.uint8)
    _assert_bits("weight_packed", got["weight_packed"], packed)
    values = NVFP4.dequantize(got, NV, dtype=torch.float32)
    _assert_bits("values", values, torch.tensor(want["values"], dtype=torch.float32))


@pytest.mark.parametrize(
    "weight",
    [random_weight(0), random_weight(1) * 1e4, random_weight(2) * 1e-30, mxfp4_ties()],
    ids=["normal", "large", "tiny", "ties"],
)
def test_mxfp4_matches_its_definition(weight: torch.Tensor) -> None:
    want = ref.mxfp4(_lists(weight))
    got = MXFP4.round_and_store(weight, MX, dtype=torch.float32)
    assert got.keys() == {"weight_packed", "weight_scale"}
    _assert_bits(
        "weight_scale", got["weight_scale"], torch.tensor(want["exponents"]).to(torch.uint8)
    )
    packed = torch.tensor(ref.pack(want["codes"]), dtype=torch.uint8)
    _assert_bits("weight_packed", got["weight_packed"], packed)
    values = MXFP4.dequantize(got, MX, dtype=torch.float32)
    _assert_bits("values", values, torch.tensor(want["values"], dtype=torch.float32))


def test_the_test_tensors_reach_the_corners() -> None:
    """The tie tensors do exercise what they claim: clipping, E4M3 ties and the 0.125 stand-in,
    E8M0's lower clamp."""
    nv = ref.nvfp4(_lists(nvfp4_ties()))
    assert nv["global"] == 1.0
    scales = [s for row in nv["scales"] for s in row]
    assert {448.0, 1.0, 2.0, 1.25, 2.0**-8, 0.125} <= set(scales)
    mx = ref.mxfp4(_lists(mxfp4_ties()))
    exponents = [e for row in mx["exponents"] for e in row]
    assert {0, 124} <= set(exponents)  # 2^-127 (clamped and zero groups), 2^-3
    assert 7 in [c & 7 for c in mx["codes"][0][32:]]  # 7.5 X clipped to 6


def test_w4a4_activation_rounding_matches_its_definition() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    x[1, :16] = torch.tensor([6.0, *ref.E2M1[1:], 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -9.0])
    g = nvfp4_global_scale(2688.0)  # 1, so row 1's first group sits on ties
    want = ref.nvfp4(_lists(x), g=float(g))
    _assert_bits("fake", nvfp4_fake_quantize(x, g), torch.tensor(want["values"]))
    g = nvfp4_global_scale(x.abs().amax() * 3)
    want = ref.nvfp4(_lists(x), g=float(g))
    _assert_bits("fake", nvfp4_fake_quantize(x, g), torch.tensor(want["values"]))


@pytest.mark.parametrize("scheme", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_round_and_store_in_row_blocks_is_the_whole_store(scheme: QuantScheme) -> None:
    w = random_weight(3)
    fmt = scheme.format
    whole = fmt.store(fmt.round_to_nearest(w, scheme), scheme, dtype=torch.float32)
    for rows in (1, 5, 12, 4096):
        blocks = fmt.round_and_store(w, scheme, dtype=torch.float32, rows=rows)
        for name, t in whole.items():
            _assert_bits(f"{name} rows={rows}", blocks[name], t)


def test_nvfp4_group_shares_one_global_scale() -> None:
    """q/k/v (gate/up) rounded together get one global scale, the largest absmax's, which is
    what vLLM's fused layers need; alone each keeps its own."""
    q, k = random_weight(0), random_weight(1) * 3
    together = NVFP4.round_and_store_group([q, k], NV, dtype=torch.float32)
    g = nvfp4_global_scale(k.abs().amax())
    for t in together:
        _assert_bits("shared", t["weight_global_scale"], g)
    alone = NVFP4.round_and_store(q, NV, dtype=torch.float32)
    assert not torch.equal(alone["weight_global_scale"], g)
    want = ref.nvfp4(_lists(q), g=float(g))
    packed = torch.tensor(ref.pack(want["codes"]), dtype=torch.uint8)
    _assert_bits("q on the shared scale", together[0]["weight_packed"], packed)
    # MXFP4 has no per-tensor scale: grouping changes nothing.
    mx = MXFP4.round_and_store_group([q, k], MX, dtype=torch.float32)
    assert torch.equal(
        mx[0]["weight_scale"], MXFP4.round_and_store(q, MX, dtype=torch.float32)["weight_scale"]
    )


# --------------------------------------------------------------------------- scheme and config


def test_registered_and_reachable_by_format_only() -> None:
    assert {"nvfp4", "mxfp4"} <= set(formats.FORMATS)
    assert formats.format_for_bits(4).kind == "int4"  # --bits 4 stays int4
    scheme, algorithm = choose_scheme(
        bits=4, method=None, fmt=None, activations="none", group_size="auto", symmetric=False
    )
    assert (scheme.kind, algorithm) == ("int4", "awq+gptq")
    for fmt, group in (("nvfp4", 16), ("mxfp4", 32)):
        scheme, algorithm = choose_scheme(
            bits=4, method=None, fmt=fmt, activations="none", group_size="auto", symmetric=False
        )
        assert scheme == QuantScheme(fmt, group, True) and algorithm == "rtn"
    assert (NV.group_size, NV.symmetric, MX.group_size) == (16, True, 32)
    assert NV.describe("gptq") == "nvfp4 e2m1 g16 (W4A16, gptq)"
    assert W4A4.describe() == "nvfp4 e2m1 g16 (W4A4 dynamic)"
    assert MX.describe() == "mxfp4 e2m1 g32 e8m0 (W4A16)"


@pytest.mark.parametrize("scheme", [NV, W4A4, MX], ids=["nvfp4", "nvfp4-w4a4", "mxfp4"])
def test_config_both_ways(scheme: QuantScheme) -> None:
    cfg = scheme_to_quantization_config(scheme)
    assert cfg["format"] == f"{scheme.kind}-pack-quantized"
    assert scheme_from_quantization_config(cfg) == scheme
    # The entries are written as compressed-tensors' presets dump them (tests/test_interop_fp4.py
    # checks them against the library); older configs without scale_dtype read the same.
    group = cfg["config_groups"]["group_0"]
    del group["weights"]["scale_dtype"]
    assert scheme_from_quantization_config(cfg) == scheme


def _config(scheme: QuantScheme, *, weights=None, acts=None, fmt=None) -> dict:
    cfg = scheme_to_quantization_config(scheme)
    group = cfg["config_groups"]["group_0"]
    group["weights"].update(weights or {})
    if acts is not None:
        group["input_activations"] = acts
    if fmt is not None:
        cfg["format"] = group["format"] = fmt
    return cfg


@pytest.mark.parametrize(
    ("scheme", "change", "message"),
    [
        (NV, {"weights": {"symmetric": False}}, "weights.symmetric: expected True, got False"),
        (NV, {"weights": {"group_size": 32}}, "weights.group_size: expected 16, got 32"),
        (NV, {"weights": {"strategy": "group"}}, "strategy: expected 'tensor_group', got 'group'"),
        (NV, {"weights": {"scale_dtype": "torch.uint8"}}, "scale_dtype: expected None or"),
        (MX, {"weights": {"symmetric": False}}, "weights.symmetric: expected True, got False"),
        (MX, {"weights": {"group_size": 16}}, "weights.group_size: expected 32, got 16"),
        (MX, {"acts": {"num_bits": 4, "type": "float"}}, "input_activations: expected null"),
        (W4A4, {"acts": {"num_bits": 8}}, "input_activations.num_bits: expected 4, got 8"),
        (W4A4, {"acts": {**W4A4.format.config_entries(W4A4)[1], "dynamic": True}},
         "input_activations.dynamic: expected 'local', got True"),
        (NV, {"fmt": "pack-quantized"}, "format: expected 'nvfp4-pack-quantized'"),
    ],
    ids=["nv-asym", "nv-g32", "nv-group", "nv-e8m0", "mx-asym", "mx-g16", "mx-w4a4", "nv-a8",
         "nv-dynamic", "nv-int-format"],
)  # fmt: skip
def test_config_refused_naming_the_field(scheme, change, message) -> None:
    with pytest.raises(CheckpointError, match="quantization_config.config_groups.group_0") as e:
        scheme_from_quantization_config(_config(scheme, **change))
    assert message in str(e.value)


def test_scheme_refusals() -> None:
    with pytest.raises(SchemeError, match="nvfp4 defines groups of 16 .* got 64"):
        QuantScheme("nvfp4", 64)
    with pytest.raises(SchemeError, match="mxfp4 defines groups of 32 .* got -1"):
        QuantScheme("mxfp4", -1)
    with pytest.raises(SchemeError, match="mxfp4 here is weight-only"):
        QuantScheme("mxfp4", activations="dynamic")
    # W4A4's input scale is a calibration result: weights alone cannot make the module.
    with pytest.raises(SchemeError, match="calibrated input_global_scale"):
        QuantLinear.from_float(random_weight(0), scheme=W4A4)


# --------------------------------------------------------------------------- tensor contract


def _nv_tensors() -> dict[str, torch.Tensor]:
    return NVFP4.round_and_store(random_weight(0), NV, dtype=torch.float32)


@pytest.mark.parametrize(
    ("scheme", "edit", "message"),
    [
        (NV, lambda t: t.update(weight_scale=t["weight_scale"].float()),
         "tensor weight_scale: expected dtype float8_e4m3fn, got float32"),
        (NV, lambda t: t.update(weight_global_scale=torch.zeros(1)),
         "weight_global_scale: expected a finite global scale > 0, got 0.0"),
        (NV, lambda t: t.update(weight_global_scale=torch.ones(2)),
         "tensor weight_global_scale: expected shape [1], got [2]"),
        (NV, lambda t: t.update(weight_packed=t["weight_packed"][:, :60]),
         "expected N > 0 and K = 2 x columns divisible by 16 (nvfp4), got N=12, K=120"),
        (NV, lambda t: t.update(weight_packed=t["weight_packed"].to(torch.int32)),
         "tensor weight_packed: expected dtype uint8, got int32"),
        (NV, lambda t: t.pop("weight_global_scale"), "missing tensor weight_global_scale"),
        (W4A4, lambda t: None, "missing tensor input_global_scale"),
        (MX, lambda t: t.update(weight_scale=torch.full_like(t["weight_scale"], 255)),
         "expected E8M0 exponents 0-254, got 48 of 255 (NaN)"),
        (MX, lambda t: t.update(weight_global_scale=torch.ones(1)),
         "unexpected tensor weight_global_scale"),
    ],
    ids=["nv-scale-dtype", "nv-global-zero", "nv-global-shape", "nv-k", "nv-packed-dtype",
         "nv-missing-global", "w4a4-missing-input", "mx-nan-scale", "mx-global"],
)  # fmt: skip
def test_contract_refused_naming_the_tensor(scheme, edit, message) -> None:
    fmt = scheme.format
    tensors = dict(
        fmt.round_and_store(random_weight(0), QuantScheme(scheme.kind), dtype=torch.float32)
    )
    edit(tensors)
    with pytest.raises(CheckpointError) as e:
        check_module_tensors(tensors, scheme=scheme)
    assert message in str(e.value)


# --------------------------------------------------------------------------- running it


@pytest.mark.parametrize("scheme", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_quant_linear_runs_on_the_reference_kernel(scheme: QuantScheme) -> None:
    w, x = random_weight(0), torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(12)
    tensors = scheme.format.round_and_store(w, scheme, dtype=torch.float32)
    layer = QuantLinear.from_tensors(tensors, scheme=scheme, bias=bias)
    assert layer._prepared().kernel == f"reference-{scheme.kind}"
    dense = scheme.format.dequantize(tensors, scheme, dtype=torch.float32)
    y = layer(x)
    assert torch.allclose(y, x @ dense.T + bias, rtol=1e-5, atol=1e-5)
    # The model dtype never touches the format's own dtypes (fp8 / E8M0 scales, fp32 global).
    layer.half()
    for name, t in tensors.items():
        _assert_bits(name, getattr(layer, name), t)
    assert layer.bias.dtype == torch.float16
    assert torch.allclose(layer(x.half()).float(), y, rtol=2e-2, atol=2e-2)


def test_w4a4_quant_linear_rounds_its_activations() -> None:
    w = random_weight(0)
    tensors = NVFP4.round_and_store(w, NV, dtype=torch.float32)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    g_in = nvfp4_global_scale(x.abs().amax())
    layer = QuantLinear.from_tensors({**tensors, "input_global_scale": g_in}, scheme=W4A4)
    dense = NVFP4.dequantize(tensors, NV, dtype=torch.float32)
    _assert_bits("w4a4", layer(x), nvfp4_fake_quantize(x, g_in) @ dense.T)
    assert not torch.allclose(layer(x), x @ dense.T, rtol=1e-3, atol=1e-3)


def test_other_backends_refuse_fp4_by_kind() -> None:
    for kernel in KERNELS:
        reason = kernel.can_implement(NV, "cpu")
        if kernel.name == "reference-nvfp4":
            assert reason is None
        elif kernel.name == "triton-nvfp4":  # CUDA (or the interpreter: test_kernels_fp4_triton)
            assert reason is not None and "picked for cuda tensors only" in reason
        else:
            assert reason is not None and "not nvfp4" in reason, (kernel.name, reason)
    assert choose_kernel(MX, "cpu").name == "reference-mxfp4"
    with pytest.raises(KernelUnavailableError, match="cpu-int4: serves int4, not mxfp4"):
        choose_kernel(MX, "cpu", "cpu")


# --------------------------------------------------------------------------- quantkit quantize


@pytest.mark.parametrize(
    ("fmt", "method"),
    [("nvfp4", "rtn"), ("mxfp4", "rtn"), ("nvfp4", "gptq"), ("mxfp4", "gptq")],
)
def test_quantize_cli(fmt: str, method: str, tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    from quantkit.format.checkpoint import load_checkpoint
    from quantkit.runtime.generate import generate
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.sampling import SamplingParams

    out = tmp_path / fmt
    calib = ["--calib-samples", "4", "--calib-seq-len", "64"] if method == "gptq" else []
    code, stdout, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), "--format", fmt, "--method", method, *calib,
        "-o", str(out), "--eval-tokens", "600",
    )  # fmt: skip
    assert code == 0, err
    assert f"{fmt} e2m1" in stdout and f"{method})" in stdout
    ppl = json.loads((out / "quantkit.json").read_text())["report"]["perplexity"]
    assert abs(ppl["quantized"] / ppl["reference"] - 1) < 0.05
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == f"{fmt}-pack-quantized"
    loaded = load_checkpoint(out)
    if fmt == "nvfp4":  # q/k/v share a global scale, gate/up another
        t = loaded.tensors
        scales = {p: t[f"model.layers.0.{p}.weight_global_scale"].item() for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj")}  # fmt: skip
        assert len({scales[p] for p in scales if "attn" in p}) == 1
        assert scales["mlp.gate_proj"] == scales["mlp.up_proj"]
    model = load_model(out)
    layer = model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantLinear) and layer.scheme.kind == fmt
    result = generate(model.model, [[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert len(result.tokens[0]) == 4


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--format", "nvfp4", "--group-size", "64"], ["nvfp4 defines groups of 16", "got 64"]),
        (["--format", "mxfp4", "--group-size", "16"], ["mxfp4 defines groups of 32", "got 16"]),
        (["--format", "nvfp4", "--method", "awq"], ["method awq: produces int4 only", "for nvfp4"]),
        (["--format", "mxfp4", "--method", "smoothquant"], ["method smoothquant", "for mxfp4"]),
        (["--format", "nvfp4", "--activations", "dynamic"], ["--activations dynamic: only"]),
        (["--format", "mxfp4", "--bits", "8"], ["--format mxfp4 means --bits 4, got --bits 8"]),
        (["--format", "nvfp4", "--calib-samples", "8"], ["calibration option", "rtn"]),
    ],
    ids=["nv-g64", "mx-g16", "nv-awq", "mx-smoothquant", "nv-w4a4", "mx-bits8", "nv-calib"],
)  # fmt: skip
def test_quantize_bad_input_one_line(args, needles, tmp_path: Path, tiny_model_dir: Path, capsys):
    code, _, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), *args, "-o", str(tmp_path / "o")
    )
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", 16), ("mxfp4", 32)])
def test_a_layer_the_fp4_group_does_not_divide_is_one_line(
    fmt: str, group: int, tmp_path: Path, capsys
) -> None:
    # hidden 40 (head_dim 10) and intermediate 72: int4 g8 would do, no FP4 group divides them.
    model = make_tokenizer(
        make_hf_model(tmp_path / "m", {"hidden_size": 40, "intermediate_size": 72})
    )
    code, _, err = run_cli(
        capsys, "quantize", str(model), "--format", fmt, "--eval-tokens", "0", "-o",
        str(tmp_path / "o"),
    )  # fmt: skip
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code != 0 and "Traceback" not in err
    assert lines[-1].startswith("error:"), err
    for needle in (f"{fmt} needs", f"multiple of its group of {group}", "got 40", "q_proj"):
        assert needle in lines[-1], (needle, lines[-1])
    assert not (tmp_path / "o").exists()
