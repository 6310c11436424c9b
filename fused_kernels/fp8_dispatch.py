"""Backend dispatch for the FP8 linear used by `QuantLinear` (W8A16 and dynamic per-token W8A8).

The same backends and rules as the INT4 dispatch (`dispatch`): CUDA -> `triton` (`fp8_triton`),
CPU -> `cpu` (`fp8_cpu`, a compiled C GEMV), anything else -> `reference` (`fp8_reference`);
`QUANTKIT_BACKEND` (or `backend=`, which wins) overrides; a backend that cannot run here falls
back (triton -> cpu -> reference) with one warning line; a Triton asked for by name and not
installed raises `KernelUnavailableError` naming the extra.

W8A8 needs fp8 matmuls: on a CUDA GPU without fp8 tensor cores (before sm_89) a W8A8 layer runs
as W8A16 (activations not quantized) and warns once. The cpu and reference backends compute W8A8
with the GPU kernel's numerics (activations rounded to fp8 per token), so a W8A8 checkpoint's
accuracy can be measured on CPU; there it is not faster than W8A16.

`prepare_fp8(...)` once per layer, then `prepared(x)`: checks, backend choice, the CPU kernel's
argument binding and its NaN-code scan happen once. `fp8_linear(x, ...)` does all of it on every
call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.errors import KernelUnavailableError, SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.dispatch import resolve_backend
from quantkit.fused_kernels.fp8_checks import check_fp8_weights
from quantkit.fused_kernels.fp8_reference import fp8_linear_reference
from quantkit.fused_kernels.w4a16_checks import check_prepared_input


def _warn(message: str) -> None:
    # One line, identical for every layer, attributed to this line: the warnings registry
    # shows it once per process.
    warnings.warn(f"quantkit: {message}", RuntimeWarning, stacklevel=2)


def resolve_fp8_backend(device: torch.device, *, override: str | None = None) -> str:
    """The FP8 backend that will run on `device`, after fallbacks (each warns once): the INT4
    dispatch's rules (`dispatch.resolve_backend`) applied to the FP8 kernels."""
    return resolve_backend(device, override=override, family="fp8")


def w8a8_supported(backend: str, device: torch.device) -> bool:
    """True if `backend` runs W8A8 on `device`: triton needs fp8 tensor cores (sm_89+); cpu and
    reference emulate the numerics everywhere."""
    if backend != "triton":
        return True
    from quantkit.fused_kernels import fp8_triton

    return fp8_triton.fp8_dot_supported(torch.device(device))


def _act_dynamic(scheme: QuantScheme) -> bool:
    if scheme.kind == "int4":
        raise SchemeError(f"fp8_linear: expected an fp8 scheme, got {scheme.describe()}")
    return scheme.activations == "dynamic"


@dataclass(frozen=True, eq=False)
class PreparedFp8:
    """One FP8 linear with its checks done and its backend chosen; call it with x.

    Holds references to the layer's tensors (no copies, nothing global); prepare again if they
    are replaced. `act_dynamic` is what runs (False after a W8A8 -> W8A16 fallback). `nbytes`:
    what a call reads for the weights (fp8 weight + scales + bias).
    """

    backend: str
    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    act_dynamic: bool
    run: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self.weight, self.weight_scale, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_prepared_input(x, in_features=self.in_features, backend=self.backend)
        return self.run(x)


def prepare_fp8(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> PreparedFp8:
    """Check one layer's compressed-tensors FP8 tensors and choose its backend, once."""
    act_dynamic = _act_dynamic(scheme)
    check_fp8_weights(weight, weight_scale, bias=bias)
    chosen = resolve_fp8_backend(weight.device, override=backend)
    if act_dynamic and not w8a8_supported(chosen, weight.device):
        _warn(
            f"W8A8 needs fp8 matmuls (CUDA sm_89+), {weight.device} has none; running W8A16 "
            "(activations not quantized)"
        )
        act_dynamic = False
    kw = dict(act_dynamic=act_dynamic, bias=bias)
    if chosen == "cpu":
        from quantkit.fused_kernels.fp8_cpu import CpuFp8Layer

        run: Callable[[torch.Tensor], torch.Tensor] = CpuFp8Layer(weight, weight_scale, **kw)
    elif chosen == "triton":
        from quantkit.fused_kernels.fp8_triton import fp8_linear_triton

        kernel = functools.partial(fp8_linear_triton, check=False, **kw)
        run = functools.partial(_on_device, kernel, chosen, weight, weight_scale)
    else:
        kernel = functools.partial(fp8_linear_reference, **kw)
        run = functools.partial(_on_device, kernel, chosen, weight, weight_scale)
    return PreparedFp8(
        backend=chosen, weight=weight, weight_scale=weight_scale, bias=bias,
        act_dynamic=act_dynamic, run=run,
    )  # fmt: skip


def _on_device(
    kernel: Callable[..., torch.Tensor],
    backend: str,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    if x.device != weight.device:
        raise KernelUnavailableError(
            f"{backend} backend: expected x on the weights' device {weight.device}, got {x.device}"
        )
    return kernel(x, weight, weight_scale)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
    prepared: PreparedFp8 | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (w8 * s).T (+ bias) for compressed-tensors FP8 weights.

    With `prepared` (from `prepare_fp8` on these same tensors) its choices are reused;
    otherwise the layer is prepared for this call only (checks, backend choice, NaN scan).
    """
    if prepared is not None:
        if prepared.weight is not weight:
            raise ValueError(
                "prepared: expected a PreparedFp8 made from this weight tensor, got one made "
                "from another"
            )
        return prepared(x)
    return prepare_fp8(weight, weight_scale, scheme=scheme, bias=bias, backend=backend)(x)
