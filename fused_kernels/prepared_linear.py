"""`PreparedLinear`: one INT4 or FP8 linear with its checks done and its kernel chosen, once.

`prepare_linear(weights, scheme=...)` checks a layer's packed weights (`packed_weights`), asks
the registry for its kernel (`kernel_registry.choose_kernel`) and binds them: a decode step then
pays only for the kernel (the checks and the choice cost ~10-15 us a linear, ~2-3 ms a token at
SmolLM2-135M's 210 linears). The cpu kernels bind the tensors' pointers to their C code here
(`CpuInt4Layer`, `CpuFp8Layer`; the FP8 one also scans the weight for NaN codes once). Nothing is
cached globally: a `PreparedLinear` holds references to the layer's own tensors, no copies;
prepare again if they are replaced.

FP8 W8A8 needs fp8 matmuls: a kernel that cannot run them on the device (Triton on a CUDA GPU
before sm_89) runs the layer as W8A16 (activations not quantized) and warns once; `act_dynamic`
says what runs. The cpu and reference kernels compute W8A8 with the GPU kernel's numerics.

Loose-tensor entry points, for callers holding a layer's tensors rather than a value:
`prepare_int4` / `int4_linear` and `prepare_fp8` / `fp8_linear` (the one-call forms check and
choose on every call). Wrong shapes raise ValueError, wrong dtypes or devices
KernelUnavailableError, both with expected-vs-got messages.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.errors import SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels import opaque
from quantkit.fused_kernels.checks import check_int4_operands, check_prepared_input
from quantkit.fused_kernels.kernel_registry import choose_kernel
from quantkit.fused_kernels.packed_weights import PackedFp8, PackedInt4, PackedWeights

__all__ = [
    "PreparedLinear",
    "fp8_linear",
    "int4_linear",
    "prepare_fp8",
    "prepare_int4",
    "prepare_linear",
]


@dataclass(frozen=True, eq=False)
class PreparedLinear:
    """One quantized linear bound to its kernel; call it with x [..., in_features].

    `kernel` names the registry entry, `backend` its backend; `run` is the bound call (for the
    cpu backend the `CpuInt4Layer` / `CpuFp8Layer` itself, which the decode step reads).
    `nbytes`: what a call reads for the weights (packed weights + scales (+ zero points) + bias).
    """

    kernel: str
    backend: str
    weights: PackedWeights
    bias: torch.Tensor | None
    act_dynamic: bool
    run: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    in_features: int = field(init=False)
    handle: int = field(init=False, repr=False)  # its number for `opaque` (Triton only)

    def __post_init__(self) -> None:
        # A field, not a property: __call__ reads it on every decode call.
        object.__setattr__(self, "in_features", self.weights.in_features)
        object.__setattr__(
            self, "handle", opaque.register(self) if self.backend == "triton" else -1
        )

    @property
    def out_features(self) -> int:
        return self.weights.out_features

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weights.nbytes + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_prepared_input(x, in_features=self.in_features, backend=self.backend)
        if self.handle >= 0 and torch.compiler.is_compiling():
            return opaque.prepared_linear(x, self.handle)  # Dynamo cannot trace Triton's launch
        return self.run(x)


def _warn(message: str) -> None:
    # One line, identical for every layer, attributed to this line: the warnings registry
    # shows it once per process.
    warnings.warn(f"quantkit: {message}", RuntimeWarning, stacklevel=2)


def prepare_linear(
    weights: PackedWeights,
    *,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> PreparedLinear:
    """Check one layer's weights, choose its kernel (`backend` overrides, as QUANTKIT_BACKEND
    does) and bind them, once. The kernels read the checkpoint layout as stored; the Triton INT4
    layer also keeps a copy by column for one-row calls (`triton.w4a16_columns`)."""
    if scheme.kind != weights.kind:
        raise SchemeError(
            f"scheme: expected kind {weights.kind} for {type(weights).__name__}, "
            f"got {scheme.describe()}"
        )
    weights.check(bias=bias)
    device = weights.device
    kernel = choose_kernel(scheme, device, backend)
    act_dynamic = scheme.activations == "dynamic"
    if act_dynamic and not kernel.supports_w8a8(device):
        _warn(
            f"W8A8 needs fp8 matmuls (CUDA sm_89+), {device} has none; running W8A16 "
            "(activations not quantized)"
        )
        act_dynamic = False
    run = kernel.bind(weights, bias=bias, act_dynamic=act_dynamic)
    return PreparedLinear(kernel.name, kernel.backend, weights, bias, act_dynamic, run)


def _made_from(prepared: PreparedLinear, tensor: torch.Tensor, name: str) -> None:
    if prepared.weights.tensors[0] is not tensor:
        raise ValueError(
            f"prepared: expected a PreparedLinear made from this {name} tensor, got one made "
            "from another"
        )


# --------------------------------------------------------------------------- loose tensors


def prepare_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    scheme: QuantScheme,
    in_features: int,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> PreparedLinear:
    """`prepare_linear` for one layer's compressed-tensors INT4 tensors."""
    tensors = dict(
        weight_packed=weight_packed, weight_scale=weight_scale, weight_zero_point=weight_zero_point
    )
    weights = PackedInt4.from_tensors(tensors, scheme=scheme, in_features=in_features)
    return prepare_linear(weights, scheme=scheme, bias=bias, backend=backend)


def int4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    scheme: QuantScheme,
    in_features: int,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
    prepared: PreparedLinear | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T (+ bias) for compressed-tensors INT4 weights.

    With `prepared` (from `prepare_int4` on these same tensors) the checks and kernel choice
    made there are reused; otherwise they run on this call (and the kernel's launcher runs
    unbound).
    """
    if prepared is not None:
        _made_from(prepared, weight_packed, "weight_packed")
        return prepared(x)
    tensors = dict(
        weight_packed=weight_packed, weight_scale=weight_scale, weight_zero_point=weight_zero_point
    )
    weights = PackedInt4.from_tensors(tensors, scheme=scheme, in_features=in_features)
    check_int4_operands(x, weights, bias=bias, backend=backend or "int4_linear")
    return choose_kernel(scheme, x.device, backend).launch(x, weights, bias=bias)


def prepare_fp8(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> PreparedLinear:
    """`prepare_linear` for one layer's compressed-tensors FP8 tensors (W8A16 or W8A8)."""
    weights = PackedFp8.from_tensors(dict(weight=weight, weight_scale=weight_scale), scheme=scheme)
    return prepare_linear(weights, scheme=scheme, bias=bias, backend=backend)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
    prepared: PreparedLinear | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (w8 * s).T (+ bias) for compressed-tensors FP8 weights.

    With `prepared` (from `prepare_fp8` on these same tensors) its choices are reused;
    otherwise the layer is prepared for this call only (checks, kernel choice, NaN scan).
    """
    if prepared is not None:
        _made_from(prepared, weight, "weight")
        return prepared(x)
    return prepare_fp8(weight, weight_scale, scheme=scheme, bias=bias, backend=backend)(x)
