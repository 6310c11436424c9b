"""FP8 kernels on CPU and their dispatch: the C backend against the pure-torch reference.

Every instruction-set variant this CPU runs (avx512, avx2, generic C) is built into a temporary
$QUANTKIT_HOME. Exact where the math is exact: e4m3 -> fp32 for all 256 codes, dequantize, and
the per-token activation quantization of W8A8 (bit-identical to `quantkit.format.packing`, on a
fixed example with rounding ties, a carry into the exponent, subnormals and -0). The GEMV and the
prefill path are held to the reference over odd shapes (K not a multiple of 64, N odd, M = 1..5
and past the GEMV limit), every activation and scale dtype, bias, W8A16 and W8A8. The Triton
kernels are tested in test_kernels_fp8_triton.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import quantkit.fused_kernels.cpu.fp8 as fc
from quantkit.errors import KernelUnavailableError, SchemeError
from quantkit.format.packing import dequantize_fp8, quantize_fp8, quantize_fp8_per_token
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.build import supported_variants
from quantkit.fused_kernels.kernel_registry import Kernel, resolve_backend
from quantkit.fused_kernels.prepared_linear import fp8_linear, prepare_fp8
from quantkit.fused_kernels.reference.fp8 import fp8_linear_reference

VARIANTS = supported_variants()
W8A16 = QuantScheme("fp8")
W8A8 = QuantScheme("fp8", activations="dynamic")

# One token whose absmax is 448, so its scale is exactly 1 and each value's e4m3 rounding is
# visible: value -> expected fp8 value (worked out by hand from the e4m3 grid).
FIXED_TOKEN = [
    (448.0, 448.0),
    (-448.0, -448.0),
    (1.0625, 1.0),  # tie between 1.0 (even) and 1.125 -> 1.0
    (1.1875, 1.25),  # tie between 1.125 and 1.25 (even) -> 1.25
    (7.75, 8.0),  # tie; rounding up carries into the exponent
    (7.95, 8.0),  # the interpreter's own fp8 cast gives 4.0 here (see fp8_triton)
    (2.0**-10, 0.0),  # subnormal tie between 0 (even) and 2^-9 -> 0
    (3 * 2.0**-10, 2.0**-8),  # subnormal tie between 2^-9 and 2^-8 (even) -> 2^-8
    (0.0155, 2.0**-6),  # just below the smallest normal, rounds up to it
    (-0.0, -0.0),
    (300.0, 288.0),  # 256 * 1.125: step 32 between 256 and 448
    (-0.3, -0.3125),
]


def fixed_token(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([[v for v, _ in FIXED_TOKEN]]).to(dtype)
    return x, torch.tensor([[e for _, e in FIXED_TOKEN]])


@pytest.fixture(scope="module", autouse=True)
def kernel_home(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("QUANTKIT_HOME", str(tmp_path_factory.mktemp("quantkit-home")))
    fc._library.cache_clear()
    yield
    fc._library.cache_clear()
    mp.undo()


@pytest.fixture(autouse=True)
def clean_backend_env(monkeypatch):
    monkeypatch.delenv("QUANTKIT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def make_layer(n: int, k: int, *, dtype=torch.float32, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w8, scale = quantize_fp8(w)
    return w8, scale.to(dtype)


def all_codes(n: int, k: int, *, finite: bool = True) -> torch.Tensor:
    """[n, k] fp8 weights cycling through every code (every finite one if `finite`)."""
    codes = torch.arange(256, dtype=torch.uint8)
    if finite:
        codes = codes[(codes & 0x7F) != 0x7F]
    return codes.repeat(n * k // len(codes) + 1)[: n * k].reshape(n, k).view(torch.float8_e4m3fn)


def tolerances(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """Both sides compute in fp32 from exact inputs (fp8 and the activations upcast exactly),
    in another order: the kernel scales the row sum once, the reference scales each weight, and
    the sums run in different orders, ~sqrt(K) * 6e-8 of sum |x| |w|; 1e-5 of it is the margin.
    bf16/fp16 outputs are rounded once on each side: rtol of one ulp."""
    magnitude = (x.float().abs() @ w.abs().T).max().item()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[x.dtype]
    return dict(atol=1e-5 * magnitude, rtol=rtol)


# --------------------------------------------------------------------------- exact parts


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scale_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_bit_exact_for_all_codes(variant: str, scale_dtype) -> None:
    w8 = all_codes(8, 100, finite=False)  # K = 100: vector body and a scalar tail
    scale = None if scale_dtype is None else torch.rand(8, 1).to(scale_dtype) * 4
    got = fc.dequantize_fp8_cpu(w8, scale, variant=variant)
    want = w8.float() if scale is None else dequantize_fp8(w8, scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN bits included
    assert got.isnan().sum() == (w8.view(torch.uint8) & 0x7F == 0x7F).sum() > 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_quantization_is_bit_exact(variant: str, dtype: torch.dtype) -> None:
    x, expected = fixed_token(dtype)
    x8, sx = fc.quantize_per_token_cpu(x, variant=variant)
    ref8, ref_s = quantize_fp8_per_token(x)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(sx, ref_s)
    if dtype == torch.float32:  # the grid values above are exact in fp32 only
        assert sx.item() == 1.0
        assert torch.equal(x8.float(), expected)
        assert x8.view(torch.uint8)[0, 9] == 0x80  # -0 keeps its sign
    # many rows over ten decades, a zero row (scale clamped to 1e-10) and 3-D input
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, 700, generator=gen) * torch.logspace(-8, 3, 9).reshape(1, 9, 1)
    x[0, 0] = 0.0
    x8, sx = fc.quantize_per_token_cpu(x.to(dtype), variant=variant)
    ref8, ref_s = quantize_fp8_per_token(x.to(dtype))
    assert x8.shape == x.shape and sx.shape == (4, 9, 1)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(sx, ref_s)


# --------------------------------------------------------------------------- GEMV and prefill

CASES = [
    # m, n, k, x dtype, scale dtype, bias
    (1, 64, 128, torch.float32, torch.float32, False),
    (1, 77, 1000, torch.bfloat16, torch.bfloat16, True),
    (2, 200, 384, torch.float16, torch.float16, True),
    (3, 9, 200, torch.float32, torch.bfloat16, False),
    (4, 576, 1536, torch.bfloat16, torch.bfloat16, False),
    (5, 13, 13, torch.float32, torch.float32, True),
    (1, 33, 14336, torch.float32, torch.float16, False),
    (16, 40, 576, torch.float16, torch.float32, True),
    (33, 50, 256, torch.bfloat16, torch.bfloat16, True),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act_dynamic", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("path", ["gemv", "prefill"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-N{}-K{}-{}".format(*c[:3], c[3]))
def test_cpu_matches_reference(variant, act_dynamic, path, case, monkeypatch) -> None:
    # fp32 math throughout (bf16 prefill on CPUs with bf16 matmuls: its own test below)
    monkeypatch.setattr(fc, "has_bf16_matmul", lambda: False)
    monkeypatch.setitem(fc.GEMV_MAX_M, variant, 1000 if path == "gemv" else 0)
    m, n, k, dtype, scale_dtype, with_bias = case
    w8, scale = make_layer(n, k, dtype=scale_dtype, seed=m)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    y = fc.fp8_linear_cpu(x, w8, scale, act_dynamic=act_dynamic, bias=bias, variant=variant)
    ref = fp8_linear_reference(
        x.float(), w8, scale, act_dynamic=act_dynamic, bias=None if bias is None else bias.float()
    )
    assert y.dtype == dtype and y.shape == (m, n)
    tol = tolerances(x, dequantize_fp8(w8, scale))  # W8A8: x8 * sx is within 7% of x
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), **tol)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemv_reads_every_finite_code(variant: str, monkeypatch) -> None:
    """All 254 finite codes (zeros, subnormals, the largest) through the GEMV's conversion."""
    monkeypatch.setitem(fc.GEMV_MAX_M, variant, 1000)
    w8 = all_codes(64, 254)
    scale = torch.rand(64, 1) + 0.5
    x = torch.randn(3, 254)
    y = fc.fp8_linear_cpu(x, w8, scale, act_dynamic=False, variant=variant)
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=False)
    torch.testing.assert_close(y, ref, **tolerances(x, dequantize_fp8(w8, scale)))


@pytest.mark.parametrize("path", ["gemv", "prefill"])
def test_nan_codes_give_nan_rows(path: str, monkeypatch) -> None:
    """The GEMV reads no NaN codes itself: the layer's scale is set to NaN for such rows."""
    monkeypatch.setitem(fc.GEMV_MAX_M, fc.cpu_variant(), 1000 if path == "gemv" else 0)
    w8, scale = make_layer(12, 96)
    codes = w8.view(torch.uint8).clone()
    codes[3, 50] = 0x7F
    codes[7, 95] = 0xFF
    w8 = codes.view(torch.float8_e4m3fn)
    x = torch.randn(2, 96)
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=False)
    for y in (fc.fp8_linear_cpu(x, w8, scale, act_dynamic=False), fc.CpuFp8Layer(w8, scale,
              act_dynamic=False)(x)):  # fmt: skip
        assert torch.equal(y.isnan(), ref.isnan()) and y.isnan()[:, [3, 7]].all()
        torch.testing.assert_close(y.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-4)


def test_bf16_prefill_path(monkeypatch) -> None:
    """bf16 activations past GEMV_MAX_M_BF16 on a bf16-matmul CPU: dequantize -> bf16 -> matmul
    (the weights are rounded to bf16 once, as the dense bf16 model does)."""
    monkeypatch.setattr(fc, "has_bf16_matmul", lambda: True)
    w8, scale = make_layer(72, 512, dtype=torch.bfloat16)
    x = torch.randn(fc.GEMV_MAX_M_BF16 + 3, 512).bfloat16()
    for act_dynamic in (False, True):
        y = fc.fp8_linear_cpu(x, w8, scale, act_dynamic=act_dynamic)
        ref = fp8_linear_reference(x.float(), w8, scale, act_dynamic=act_dynamic)
        mag = (x.float().abs() @ dequantize_fp8(w8, scale).abs().T).max().item()
        torch.testing.assert_close(y.float(), ref, atol=2.0**-8 * mag, rtol=2.0**-7)


def test_layer_views_leading_dims_and_copies() -> None:
    w8, scale = make_layer(40, 256)
    layer = fc.CpuFp8Layer(w8, scale, act_dynamic=True)
    x = torch.randn(256, 6).T.reshape(2, 3, 256)  # non-contiguous, 3-D
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=True)
    y = layer(x)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    assert layer(x[:0]).shape == (0, 3, 40)
    # the bound struct holds raw pointers: a copy rebinds to the copied tensors
    clone = copy.deepcopy(layer)
    assert clone.tensors[0] is not layer.tensors[0]
    torch.testing.assert_close(clone(x), y, rtol=0, atol=0)


def test_cpu_rejects_bad_inputs() -> None:
    w8, scale = make_layer(40, 256)
    with pytest.raises(KernelUnavailableError, match="got torch.float64"):
        fc.fp8_linear_cpu(torch.randn(1, 256).double(), w8, scale, act_dynamic=False)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 256\].*got \(1, 100\)"):
        fc.fp8_linear_cpu(torch.randn(1, 100), w8, scale, act_dynamic=False)
    with pytest.raises(ValueError, match=r"weight: expected a 2-D float8_e4m3fn.*torch.float32"):
        fc.fp8_linear_cpu(torch.randn(1, 256), w8.float(), scale, act_dynamic=False)
    with pytest.raises(ValueError, match=r"weight_scale: expected a float \[40, 1\].*\(40, 2\)"):
        fc.fp8_linear_cpu(torch.randn(1, 256), w8, scale.repeat(1, 2), act_dynamic=False)
    with pytest.raises(ValueError, match=r"bias: expected a float \[40\] tensor"):
        fc.CpuFp8Layer(w8, scale, act_dynamic=False, bias=torch.ones(41))


# --------------------------------------------------------------------------- dispatch


def test_backend_choice_and_fallback(monkeypatch) -> None:
    assert resolve_backend(torch.device("cpu"), kind="fp8") == "cpu"
    assert resolve_backend(torch.device("meta"), kind="fp8") == "reference"
    monkeypatch.setenv("QUANTKIT_BACKEND", "reference")
    assert resolve_backend(torch.device("cpu"), kind="fp8") == "reference"
    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")  # CPU tensors without the interpreter
    with pytest.warns(RuntimeWarning) as caught:
        assert resolve_backend(torch.device("cpu"), kind="fp8") == "cpu"
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "triton backend unavailable" in str(caught[0].message)
    monkeypatch.setenv("QUANTKIT_BACKEND", "cuda")
    with pytest.raises(KernelUnavailableError, match="expected one of triton, cpu, reference"):
        resolve_backend(torch.device("cpu"), kind="fp8")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("scheme", [W8A16, W8A8], ids=["w8a16", "w8a8"])
def test_prepared_and_unprepared_match_reference(backend: str, scheme: QuantScheme) -> None:
    w8, scale = make_layer(72, 256, dtype=torch.bfloat16)
    bias = torch.randn(72).bfloat16()
    x = torch.randn(3, 256).bfloat16()
    act = scheme.activations == "dynamic"
    ref = fp8_linear_reference(x, w8, scale, act_dynamic=act, bias=bias)
    prepared = prepare_fp8(w8, scale, scheme=scheme, bias=bias, backend=backend)
    assert prepared.backend == backend and prepared.act_dynamic == act
    assert prepared.nbytes == 72 * 256 + 72 * 2 + 72 * 2
    for y in (prepared(x), fp8_linear(x, w8, scale, scheme=scheme, bias=bias, backend=backend),
              fp8_linear(x, w8, scale, scheme=scheme, bias=bias, prepared=prepared)):  # fmt: skip
        torch.testing.assert_close(y, ref, rtol=2.0**-7, atol=1e-2)


def test_w8a8_without_fp8_matmuls_falls_back_to_w8a16(monkeypatch) -> None:
    """A device without fp8 matmuls (a CUDA GPU before sm_89; faked here) runs W8A8 layers as
    W8A16 and says so in one warning line."""
    monkeypatch.setattr(Kernel, "supports_w8a8", lambda kernel, device: False)
    w8, scale = make_layer(72, 256)
    x = torch.randn(2, 256)
    with pytest.warns(RuntimeWarning) as caught:
        prepared = prepare_fp8(w8, scale, scheme=W8A8)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message and "W8A8 needs fp8 matmuls" in message and "W8A16" in message
    assert prepared.act_dynamic is False
    want = fp8_linear_reference(x, w8, scale, act_dynamic=False)
    torch.testing.assert_close(prepared(x), want, rtol=1e-5, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # W8A16 layers never warn
        prepare_fp8(w8, scale, scheme=W8A16)


def test_dispatch_errors() -> None:
    w8, scale = make_layer(72, 256)
    prepared = prepare_fp8(w8, scale, scheme=W8A16)
    with pytest.raises(SchemeError, match="expected an fp8 scheme, got"):
        prepare_fp8(w8, scale, scheme=QuantScheme("int4", group_size=64))
    with pytest.raises(ValueError, match="made from another"):
        fp8_linear(torch.randn(1, 256), w8.clone(), scale, scheme=W8A16, prepared=prepared)
    with pytest.raises(ValueError, match=r"expected shape \[\.\.\., 256\]"):
        prepared(torch.randn(1, 255))
    with pytest.raises(KernelUnavailableError, match="got torch.int32"):
        prepared(torch.ones(1, 256, dtype=torch.int32))
    with pytest.raises(KernelUnavailableError, match="cpu backend: expected CPU tensors"):
        prepare_fp8(w8.to("meta"), scale.to("meta"), scheme=W8A16, backend="cpu")


def test_quant_linear_runs_the_cpu_kernel_once_prepared() -> None:
    from quantkit.runtime.quant_linear import QuantLinear

    linear = torch.nn.Linear(256, 72).bfloat16()
    for scheme in (W8A16, W8A8):
        q = QuantLinear.from_float(linear, scheme=scheme)
        x = torch.randn(2, 5, 256).bfloat16()
        y = q(x)
        prepared = q._prepared()
        assert prepared.backend == "cpu" and q._prepared() is prepared  # cached
        act = scheme.activations == "dynamic"
        ref = fp8_linear_reference(x, q.weight, q.weight_scale, act_dynamic=act, bias=q.bias)
        torch.testing.assert_close(y, ref, rtol=2.0**-7, atol=1e-2)
        q.half()  # a new scale tensor: prepared again, for the new dtype
        assert q._prepared() is not prepared
        assert q._prepared().weights.weight_scale.dtype == torch.float16
        torch.testing.assert_close(copy.deepcopy(q)(x.half()), q(x.half()), rtol=0, atol=0)


def test_bench_fp8_rows(capsys) -> None:
    from quantkit.evals.kernels import bench_w4a16 as bench

    args = ["--device", "cpu", "--shapes", "64x256,72x128", "--m", "1,40", "--budget", "0"]
    rows = bench.main([*args, "--impls", "fp8,fp8-w8a8,dense-bf16", "--sweep-mb", "0.05"])
    assert "copy bandwidth" in capsys.readouterr().out
    labels = {r.impl for r in rows}
    assert labels == {"fp8 cpu", "fp8-w8a8 cpu", "dense-bf16"}
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert 0 < r.p20_ms <= r.median_ms <= r.p80_ms and r.weight_gbps > 0
    fp8 = [r for r in rows if r.impl.startswith("fp8")]
    # one byte per weight + one bf16 scale per row, against two bytes per weight
    assert all(r.weight_bytes == r.n * r.k + 2 * r.n for r in fp8)
    with pytest.raises(SystemExit, match="expected a CUDA device"):
        bench.main([*args, "--impls", "scaled-mm"])
