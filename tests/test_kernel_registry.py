"""The kernel registry: one priority list, one chooser, one error listing every reason.

The choices pinned here are the ones the two per-format dispatchers made before the registry:
CPU -> cpu (reference without a C compiler), CUDA -> triton (reference without Triton), any
other device -> reference; QUANTKIT_BACKEND / `override` start the walk at the named backend.
CUDA cases stub the Triton entry's blocker, so nothing here imports Triton or needs a GPU.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import quantkit.fused_kernels.cpu.fp8 as fc
import quantkit.fused_kernels.cpu.w4a16 as wc
from quantkit.errors import KernelUnavailableError, SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels import kernel_registry
from quantkit.fused_kernels.kernel_registry import BACKENDS, KERNELS, Kernel, choose_kernel
from quantkit.fused_kernels.packed_weights import PackedFp8, PackedInt4, packed_weights
from quantkit.fused_kernels.prepared_linear import PreparedLinear, prepare_int4, prepare_linear
from quantkit.fused_kernels.reference.w4a16 import w4a16_linear_reference
from quantkit.runtime.quant_linear import QuantLinear

INT4 = QuantScheme("int4", group_size=64)
FP8 = QuantScheme("fp8")
W8A8 = QuantScheme("fp8", activations="dynamic")


@pytest.fixture(scope="module", autouse=True)
def kernel_home(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("QUANTKIT_HOME", str(tmp_path_factory.mktemp("quantkit-home")))
    wc._library.cache_clear()
    fc._library.cache_clear()
    yield
    wc._library.cache_clear()
    fc._library.cache_clear()
    mp.undo()


@pytest.fixture(autouse=True)
def clean_backend_env(monkeypatch):
    monkeypatch.delenv("QUANTKIT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def entry(name: str) -> Kernel:
    return next(k for k in KERNELS if k.name == name)


def with_triton(blocker) -> tuple[Kernel, ...]:
    """KERNELS with the Triton entries' blocker replaced (no Triton import, no GPU)."""
    return tuple(replace(k, blocker=blocker) if k.backend == "triton" else k for k in KERNELS)


def chosen(scheme, device, override=None, **kw) -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = choose_kernel(scheme, device, override, **kw).name
    return name, [str(w.message) for w in caught]


def test_one_priority_list_covers_both_formats() -> None:
    assert [k.name for k in KERNELS] == [
        "triton-int4", "triton-fp8", "triton-nvfp4", "triton-mxfp4", "cpu-int4", "cpu-fp8",
        "cpu-int8", "reference-int4", "reference-fp8", "reference-int8", "reference-nvfp4",
        "reference-mxfp4",
    ]  # fmt: skip
    assert BACKENDS == ("triton", "cpu", "reference")
    assert len({k.name for k in KERNELS}) == len(KERNELS)


def test_nothing_fits_raises_one_error_listing_every_reason() -> None:
    int2 = SimpleNamespace(kind="int2", activations="none")  # a kind no kernel serves
    with pytest.raises(KernelUnavailableError) as err:
        choose_kernel(int2, "cpu")  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message and message.startswith("no kernel runs int2 weights on cpu")
    for k in KERNELS:
        assert f"{k.name}: serves {k.kinds[0]}, not int2" in message


def test_every_tried_kernel_failing_warns_then_lists_all_reasons() -> None:
    fast = replace(entry("cpu-int4"), name="fast-int4", backend="fast",
                   blocker=lambda k, d, r: "no fast here")  # fmt: skip
    slow = replace(entry("cpu-int4"), name="slow-int4", backend="slow",
                   blocker=lambda k, d, r: "no slow either")  # fmt: skip
    gpu = replace(entry("reference-int4"), name="gpu-int4", backend="gpu", devices=("cuda",))
    with pytest.warns(RuntimeWarning) as caught, pytest.raises(KernelUnavailableError) as err:
        choose_kernel(INT4, "cpu", kernels=(fast, gpu, slow))
    assert [str(w.message) for w in caught] == [
        "quantkit: fast backend unavailable (no fast here); using slow"
    ]
    message = str(err.value)
    assert "fast-int4: no fast here" in message and "slow-int4: no slow either" in message
    assert "gpu-int4: picked for cuda tensors only, got cpu" in message


def test_priority_order_picks_what_the_dispatchers_picked() -> None:
    assert chosen(INT4, "cpu") == ("cpu-int4", [])
    assert chosen(FP8, "cpu") == ("cpu-fp8", [])
    assert chosen(W8A8, "cpu") == ("cpu-fp8", [])
    assert chosen(INT4, "meta") == ("reference-int4", [])
    assert chosen(FP8, "meta") == ("reference-fp8", [])
    ok = with_triton(lambda k, d, r: None)
    assert chosen(INT4, "cuda", kernels=ok) == ("triton-int4", [])
    assert chosen(W8A8, "cuda", kernels=ok) == ("triton-fp8", [])


def test_triton_is_not_picked_for_cpu_tensors_unless_asked(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok = with_triton(lambda k, d, r: None)
    assert chosen(INT4, "cpu", kernels=ok) == ("cpu-int4", [])
    assert chosen(INT4, "cpu", "triton", kernels=ok) == ("triton-int4", [])


def test_c_kernel_unavailable_falls_back_to_reference(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-qk")
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path))  # no cached build to find
    wc._library.cache_clear()
    fc._library.cache_clear()
    try:
        for scheme, name in ((INT4, "reference-int4"), (FP8, "reference-fp8")):
            assert chosen(scheme, "cpu") == (
                name,
                ["quantkit: cpu backend unavailable (the C kernel did not build (is gcc "
                 "installed?)); using reference"],
            )  # fmt: skip
    finally:
        wc._library.cache_clear()
        fc._library.cache_clear()


def test_cuda_without_triton_falls_back_to_reference_not_cpu() -> None:
    missing = with_triton(lambda k, d, r: "the triton package is not installed")
    name, messages = chosen(INT4, "cuda", kernels=missing)
    assert name == "reference-int4"
    assert messages == [
        "quantkit: triton backend unavailable (the triton package is not installed); "
        "using reference"
    ]


def test_triton_asked_for_and_not_installed_raises_naming_the_extra() -> None:
    absent = tuple(
        replace(k, module="no_such_kernel_module_qk") if k.backend == "triton" else k
        for k in KERNELS
    )
    with pytest.raises(KernelUnavailableError, match=r"pip install 'quantkit\[kernels\]'"):
        choose_kernel(INT4, "cuda", "triton", kernels=absent)
    name, messages = chosen(INT4, "cuda", kernels=absent)  # not asked for: falls back
    assert name == "reference-int4" and "the triton package is not installed" in messages[0]


def test_override_and_environment(monkeypatch) -> None:
    # QUANTKIT_BACKEND=triton on CPU tensors without the interpreter: one line, then cpu
    name, messages = chosen(INT4, "cpu", "triton")
    assert name == "cpu-int4"
    assert messages == [
        "quantkit: triton backend unavailable (triton needs CUDA tensors, or TRITON_INTERPRET=1 "
        "for CPU tensors); using cpu"
    ]
    assert chosen(FP8, "meta", "triton")[0] == "reference-fp8"  # warns, skips cpu
    assert chosen(FP8, "cpu", "reference") == ("reference-fp8", [])
    monkeypatch.setenv("QUANTKIT_BACKEND", "reference")
    assert chosen(INT4, "cpu") == ("reference-int4", [])
    assert chosen(INT4, "cpu", "cpu") == ("cpu-int4", [])  # the argument wins
    with pytest.raises(KernelUnavailableError, match="cpu backend: expected CPU tensors, got meta"):
        choose_kernel(INT4, "meta", "cpu")  # asked for by name: refused, not hidden
    monkeypatch.setenv("QUANTKIT_BACKEND", "cuda-magic")
    with pytest.raises(KernelUnavailableError, match="expected one of triton, cpu, reference"):
        choose_kernel(INT4, "cpu")


def test_can_implement_says_why_not() -> None:
    cpu = entry("cpu-int4")
    assert cpu.can_implement(INT4, "cpu") is None
    assert cpu.can_implement(FP8, "cpu") == "serves int4, not fp8"
    assert "picked for cpu tensors only, got meta" in cpu.can_implement(INT4, "meta")
    with pytest.raises(KernelUnavailableError, match="expected CPU tensors"):
        cpu.can_implement(INT4, "meta", requested=True)
    triton = entry("triton-fp8")
    assert triton.can_implement(FP8, "cpu", requested=True) == (
        "triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
    )
    meta = triton.can_implement(FP8, "meta", requested=True)
    assert meta == "triton does not run on meta tensors"
    assert entry("reference-fp8").can_implement(W8A8, "meta") is None


def test_a_new_backend_is_one_entry(monkeypatch) -> None:
    new = Kernel("mine-int4", "mine", ("int4",), "reference.w4a16", "w4a16_linear_reference",
                 devices=("cpu",), takes_check=False)  # fmt: skip
    monkeypatch.setattr(kernel_registry, "KERNELS", (new, *KERNELS))
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    q = QuantLinear.from_float(w, scheme=INT4)
    tensors = (q.weight_packed, q.weight_scale, q.weight_zero_point)
    prepared = prepare_int4(*tensors, scheme=INT4, in_features=128)
    assert (prepared.kernel, prepared.backend) == ("mine-int4", "mine")
    x = torch.randn(3, 128)
    ref = w4a16_linear_reference(x, PackedInt4(*tensors, 128, 64))
    assert torch.equal(prepared(x), ref)
    assert chosen(INT4, "cpu", "cpu")[0] == "cpu-int4"
    assert chosen(INT4, "cpu", "mine")[0] == "mine-int4"


@pytest.mark.parametrize("scheme", [INT4, QuantScheme("int4", group_size=-1), FP8, W8A8])
def test_one_prepared_type_for_both_formats(scheme: QuantScheme) -> None:
    linear = torch.nn.Linear(128, 48)
    q = QuantLinear.from_float(linear, scheme=scheme)
    prepared = q._prepared()
    assert type(prepared) is PreparedLinear and q._prepared() is prepared
    assert prepared.backend == "cpu" and prepared.kernel == f"cpu-{scheme.kind}"
    assert (prepared.in_features, prepared.out_features) == (128, 48)
    assert prepared.nbytes == q.weight_bytes()
    assert prepared.act_dynamic == (scheme.activations == "dynamic")
    weights = prepared.weights
    assert isinstance(weights, PackedInt4 if scheme.kind == "int4" else PackedFp8)
    assert weights.tensors[0] is (q.weight_packed if scheme.kind == "int4" else q.weight)
    x = torch.randn(2, 128)
    assert torch.equal(q(x), prepared(x))
    same = prepare_linear(weights, scheme=scheme, bias=q.bias, backend="reference")
    assert same.kernel == f"reference-{scheme.kind}"
    torch.testing.assert_close(same(x), prepared(x), rtol=1e-4, atol=1e-4)


def test_packed_weights_from_module_tensors() -> None:
    q = QuantLinear.from_float(torch.randn(40, 256), scheme=QuantScheme("int4", group_size=-1))
    w = packed_weights(dict(q.named_buffers()), scheme=q.scheme, in_features=256)
    assert isinstance(w, PackedInt4) and w.group_size == 256 and w.out_features == 40
    assert w.nbytes == 40 * 32 * 4 + 40 * 4 + 5 * 4
    with pytest.raises(SchemeError, match="expected an fp8 scheme"):
        PackedFp8.from_tensors(dict(q.named_buffers()), scheme=q.scheme)
    with pytest.raises(SchemeError, match="expected kind fp8 for PackedFp8"):
        f = QuantLinear.from_float(torch.randn(40, 256), scheme=FP8)
        prepare_linear(PackedFp8(f.weight, f.weight_scale), scheme=INT4)
