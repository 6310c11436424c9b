"""Backend choice, fallbacks and the public INT4 entry points (`int4_linear`, `prepare_int4`).

The Triton-backed path is tested under the interpreter in test_kernels_triton.py; the registry's
walk itself in test_kernel_registry.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import quantkit.fused_kernels.cpu.w4a16 as cpu
from quantkit.errors import KernelUnavailableError, SchemeError
from quantkit.format.packing import int4_qparams, int4_quantize, pack_int4, pack_zero_points
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.kernel_registry import choose_kernel, resolve_backend
from quantkit.fused_kernels.packed_weights import PackedInt4
from quantkit.fused_kernels.prepared_linear import PreparedLinear, int4_linear, prepare_int4
from quantkit.fused_kernels.reference.w4a16 import w4a16_linear_reference

SCHEME = QuantScheme("int4", group_size=64)


@pytest.fixture(scope="module", autouse=True)
def kernel_home(tmp_path_factory: pytest.TempPathFactory):
    """One temporary QUANTKIT_HOME for this module's kernel builds (a build is one gcc call)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QUANTKIT_HOME", str(tmp_path_factory.mktemp("quantkit-home")))
    cpu._library.cache_clear()
    yield
    cpu._library.cache_clear()
    mp.undo()


@pytest.fixture(autouse=True)
def clean_backend_env(monkeypatch):
    monkeypatch.delenv("QUANTKIT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def layer():
    w = torch.randn(72, 256, generator=torch.Generator().manual_seed(0))
    scale, zero = int4_qparams(w, group_size=64, symmetric=False)
    codes = int4_quantize(w, scale, zero, group_size=64)
    return pack_int4(codes), scale.to(torch.bfloat16), pack_zero_points(zero)


def test_choose_kernel_by_device_and_override(monkeypatch) -> None:
    assert choose_kernel(SCHEME, torch.device("cpu")).name == "cpu-int4"
    assert choose_kernel(SCHEME, torch.device("meta")).name == "reference-int4"
    monkeypatch.setenv("QUANTKIT_BACKEND", "reference")
    assert choose_kernel(SCHEME, torch.device("cpu")).name == "reference-int4"
    assert choose_kernel(SCHEME, "cpu", override="cpu").name == "cpu-int4"  # the argument wins
    monkeypatch.setenv("QUANTKIT_BACKEND", "cuda-magic")
    with pytest.raises(KernelUnavailableError, match="expected one of triton, cpu, reference"):
        choose_kernel(SCHEME, torch.device("cpu"))


def test_triton_on_cpu_falls_back_with_one_warning(monkeypatch, layer) -> None:
    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            y = int4_linear(x, *layer, scheme=SCHEME, in_features=256)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "triton backend unavailable" in messages[0] and "using cpu" in messages[0]
    assert "\n" not in messages[0]
    ref = w4a16_linear_reference(x, PackedInt4(*layer, 256, 64))
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3)


def test_cpu_without_compiler_falls_back_to_reference(monkeypatch, tmp_path, layer) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-qk")
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path))  # no cached build to find
    cpu._library.cache_clear()
    with pytest.warns(RuntimeWarning, match="cpu backend unavailable.*using reference"):
        assert resolve_backend(torch.device("cpu")) == "reference"
    x = torch.randn(2, 256)
    with pytest.warns(RuntimeWarning):
        y = int4_linear(x, *layer, scheme=SCHEME, in_features=256)
    assert torch.equal(y, w4a16_linear_reference(x, PackedInt4(*layer, 256, 64)))
    cpu._library.cache_clear()  # the failed build is not cached, but be explicit


def test_cpu_backend_refuses_other_devices() -> None:
    with pytest.raises(KernelUnavailableError, match="cpu backend: expected CPU tensors, got meta"):
        resolve_backend(torch.device("meta"), override="cpu")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_int4_linear_matches_reference(backend: str, layer) -> None:
    x = torch.randn(2, 5, 256, dtype=torch.float32)
    bias = torch.randn(72)
    y = int4_linear(x, *layer, scheme=SCHEME, in_features=256, bias=bias, backend=backend)
    ref = w4a16_linear_reference(x, PackedInt4(*layer, 256, 64), bias=bias)
    assert y.shape == (2, 5, 72)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_prepared_layer(layer) -> None:
    bias = torch.randn(72, dtype=torch.bfloat16)
    prepared = prepare_int4(*layer, scheme=SCHEME, in_features=256, bias=bias)
    assert isinstance(prepared, PreparedLinear)
    assert prepared.backend == "cpu" and prepared.kernel == "cpu-int4"
    assert prepared.out_features == 72
    packed, scale, zero = layer
    assert prepared.nbytes == 72 * 32 * 4 + 72 * 4 * 2 + 9 * 4 * 4 + 72 * 2
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    y = prepared(x)
    same = int4_linear(x, *layer, scheme=SCHEME, in_features=256, bias=bias, prepared=prepared)
    assert torch.equal(y, same)
    ref = w4a16_linear_reference(x, PackedInt4(*layer, 256, 64), bias=bias)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3)
    with pytest.raises(ValueError, match="made from this weight_packed"):
        int4_linear(x, packed.clone(), scale, zero, scheme=SCHEME, in_features=256,
                    prepared=prepared)  # fmt: skip
    with pytest.raises(ValueError, match=r"expected shape \[\.\.\., 256\]"):
        prepared(torch.randn(4, 128))
    with pytest.raises(KernelUnavailableError, match="got torch.float64"):
        prepared(torch.randn(4, 256, dtype=torch.float64))


def test_scheme_errors(layer) -> None:
    x = torch.randn(1, 256)
    with pytest.raises(SchemeError, match="expected an INT4 scheme, got fp8"):
        int4_linear(x, *layer, scheme=QuantScheme("fp8"), in_features=256)
    with pytest.raises(SchemeError, match="still 'auto'"):
        prepare_int4(*layer, scheme=QuantScheme("int4"), in_features=256)
    with pytest.raises(ValueError, match="weight_scale: expected a float \\[72, 8\\]"):
        int4_linear(x, *layer, scheme=QuantScheme("int4", group_size=32), in_features=256)


def test_shape_and_dtype_errors(layer) -> None:
    packed, scale, zero = layer
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 256\].*got \(1, 255\)"):
        int4_linear(torch.randn(1, 255), *layer, scheme=SCHEME, in_features=256)
    with pytest.raises(KernelUnavailableError, match="got torch.int64"):
        int4_linear(torch.ones(1, 256, dtype=torch.int64), *layer, scheme=SCHEME, in_features=256)
    with pytest.raises(ValueError, match="weight_packed: expected a 2-D int32"):
        int4_linear(torch.randn(1, 256), packed.long(), scale, zero, scheme=SCHEME,
                    in_features=256)  # fmt: skip
    with pytest.raises(ValueError, match=r"weight_zero_point: expected int32 \[9, 4\]"):
        int4_linear(torch.randn(1, 256), packed, scale, zero.T.contiguous(), scheme=SCHEME,
                    in_features=256)  # fmt: skip
