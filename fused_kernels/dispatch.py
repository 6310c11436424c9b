"""Backend dispatch for the INT4 linear used by `QuantLinear`.

Backends:

- `triton`: the fused Triton kernels (`w4a16_triton`), for CUDA tensors, or CPU tensors under
  `TRITON_INTERPRET=1` (tests; fp16/fp32 only).
- `cpu`: a compiled C GEMV for decode and dequantize + MKL for prefill (`w4a16_cpu`); built with
  gcc on first use and cached under $QUANTKIT_HOME.
- `reference`: dequantize with `quantkit.format.packing` and matmul in fp32 (`w4a16_reference`);
runs
  anywhere, slowly.

Default: CUDA -> triton, CPU -> cpu, anything else -> reference. `QUANTKIT_BACKEND` (or the
`backend=` argument, which wins) overrides. When the chosen backend cannot run here (triton on
CPU without the interpreter, no C compiler for `cpu`, no Triton for an automatic CUDA choice)
the call falls back (triton -> cpu -> reference) and warns with one line; the warnings module
shows a given line once. A backend asked for by name whose package is missing (Triton) raises
`KernelUnavailableError` naming the extra to install. Wrong shapes raise ValueError, wrong
dtypes or devices KernelUnavailableError, both with expected-vs-got messages.

Two ways to call:

- `int4_linear(x, ...)`: checks the operands and picks the backend on every call.
- `prepare_int4(...)` once per layer, then `prepared(x)`: the weight checks and the backend
  choice happen once, so a decode step pays only for the kernel (~10 us of Python checks saved
  per linear; at SmolLM2-135M's 210 linears per token that is ~2 ms a token). Nothing is
  cached globally: the `PreparedInt4` holds references to the layer's own tensors, no copies.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.errors import KernelUnavailableError, SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.w4a16_checks import (
    check_int4_operands,
    check_int4_weights,
    check_prepared_input,
    resolve_group_size,
)
from quantkit.fused_kernels.w4a16_reference import w4a16_linear_reference

BACKENDS = ("triton", "cpu", "reference")


def choose_backend(device: torch.device, *, override: str | None = None) -> str:
    """The backend wanted on `device`: `override`, else $QUANTKIT_BACKEND, else by device.

    This is the wish; `resolve_backend` checks that it can run and falls back if not.
    """
    wanted = override or os.environ.get("QUANTKIT_BACKEND") or None
    if wanted is None:
        return {"cuda": "triton", "cpu": "cpu"}.get(torch.device(device).type, "reference")
    if wanted not in BACKENDS:
        raise KernelUnavailableError(
            f"backend: expected one of {', '.join(BACKENDS)} (argument or QUANTKIT_BACKEND), "
            f"got {wanted!r}"
        )
    return wanted


def _triton_blocker(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device` without importing anything, or None."""
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"triton does not run on {device.type} tensors"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
    return None


# Per kernel family: the Triton module (it defines `is_interpreted`), and the CPU module and its
# "did the C kernel build" function. Imported lazily: resolving never imports what cannot run.
_FAMILIES = {
    "w4a16": (
        "quantkit.fused_kernels.w4a16_triton",
        "quantkit.fused_kernels.w4a16_cpu",
        "cpu_kernel_available",
    ),
    "fp8": (
        "quantkit.fused_kernels.fp8_triton",
        "quantkit.fused_kernels.fp8_cpu",
        "fp8_cpu_available",
    ),
}


def _import_triton_kernels(module: str, *, required: bool) -> str | None:
    """Import a Triton kernel module; None if it can run, else why not (or raise if required)."""
    try:
        kernels = importlib.import_module(module)
    except ImportError as exc:
        if required:
            raise KernelUnavailableError(
                f"triton backend: expected the triton package, got ImportError ({exc}); "
                "install it with: pip install 'quantkit[kernels]'"
            ) from exc
        return "the triton package is not installed (pip install 'quantkit[kernels]')"
    if os.environ.get("TRITON_INTERPRET") == "1" and not kernels.is_interpreted():
        return "TRITON_INTERPRET=1 was set after the Triton kernels were imported"
    return None


def resolve_backend(
    device: torch.device, *, override: str | None = None, family: str = "w4a16"
) -> str:
    """The backend that will actually run on `device` for a kernel `family` (w4a16 or fp8),
    after fallbacks (each warns once)."""
    triton_module, cpu_module, cpu_check = _FAMILIES[family]
    device = torch.device(device)
    explicit = bool(override or os.environ.get("QUANTKIT_BACKEND"))
    backend = choose_backend(device, override=override)
    if backend == "triton":
        # Check the device first: a CPU run without the interpreter never imports Triton.
        reason = _triton_blocker(device) or _import_triton_kernels(triton_module, required=explicit)
        if reason is None:
            return "triton"
        backend = "cpu" if device.type == "cpu" else "reference"
        _warn_fallback("triton", backend, reason)
    if backend == "cpu":
        if device.type != "cpu":
            raise KernelUnavailableError(
                f"cpu backend: expected CPU tensors, got {device} (unset QUANTKIT_BACKEND=cpu)"
            )
        if getattr(importlib.import_module(cpu_module), cpu_check)():
            return "cpu"
        _warn_fallback("cpu", "reference", "the C kernel did not build (is gcc installed?)")
        return "reference"
    return backend


def _warn_fallback(wanted: str, used: str, reason: str) -> None:
    # One line, identical for every layer, so the warnings registry shows it once.
    warnings.warn(
        f"quantkit: {wanted} backend unavailable ({reason}); using {used}",
        RuntimeWarning,
        stacklevel=3,
    )


def _kernel(backend: str) -> Callable[..., torch.Tensor]:
    if backend == "triton":
        from quantkit.fused_kernels.w4a16_triton import w4a16_linear_triton

        return w4a16_linear_triton
    if backend == "cpu":
        from quantkit.fused_kernels.w4a16_cpu import w4a16_linear_cpu

        return w4a16_linear_cpu
    return _reference


def _reference(x: torch.Tensor, *args: torch.Tensor | None, check: bool = True, **kw: object):
    # The reference takes no `check`; its dequantize-and-matmul has no fast path to protect.
    return w4a16_linear_reference(x, *args, **kw)


def _group_size(scheme: QuantScheme, in_features: int) -> int:
    if scheme.kind != "int4":
        raise SchemeError(f"int4_linear: expected an INT4 scheme, got {scheme.describe()}")
    if not scheme.is_resolved:
        raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
    return resolve_group_size(int(scheme.group_size), in_features)


@dataclass(frozen=True, eq=False)
class PreparedInt4:
    """One INT4 linear with its checks done and its backend chosen; call it with x.

    Holds references to the layer's tensors (no copies, nothing global); prepare again if the
    layer's tensors are replaced. `nbytes` is what a call reads from memory for the weights:
    packed ints + scales + zero points (+ bias).
    """

    backend: str
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    bias: torch.Tensor | None
    in_features: int
    group_size: int
    run: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)

    @property
    def out_features(self) -> int:
        return self.weight_packed.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self.weight_packed, self.weight_scale, self.weight_zero_point, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_prepared_input(x, in_features=self.in_features, backend=self.backend)
        return self.run(x)


def prepare_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    scheme: QuantScheme,
    in_features: int,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> PreparedInt4:
    """Check one layer's compressed-tensors INT4 tensors and choose its backend, once.

    No repack: every backend reads the checkpoint layout as stored. The cpu backend binds the
    tensors' pointers to its C kernel here (`CpuInt4Layer`): a decode call then costs the
    kernel plus ~5 us.
    """
    group_size = _group_size(scheme, in_features)
    check_int4_weights(
        weight_packed, weight_scale, weight_zero_point, in_features=in_features,
        group_size=group_size, bias=bias,
    )  # fmt: skip
    chosen = resolve_backend(weight_packed.device, override=backend)
    tensors = (weight_packed, weight_scale, weight_zero_point)
    if chosen == "cpu":
        from quantkit.fused_kernels.w4a16_cpu import CpuInt4Layer

        run = CpuInt4Layer(*tensors, in_features=in_features, group_size=group_size, bias=bias)
    else:
        run = functools.partial(
            _run_checked_device, _kernel(chosen), chosen, tensors,
            dict(in_features=in_features, group_size=group_size, bias=bias, check=False),
        )  # fmt: skip
    return PreparedInt4(
        backend=chosen,
        weight_packed=weight_packed,
        weight_scale=weight_scale,
        weight_zero_point=weight_zero_point,
        bias=bias,
        in_features=in_features,
        group_size=group_size,
        run=run,
    )


def _run_checked_device(
    kernel: Callable[..., torch.Tensor],
    backend: str,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    kwargs: dict,
    x: torch.Tensor,
) -> torch.Tensor:
    if x.device != tensors[0].device:
        raise KernelUnavailableError(
            f"{backend} backend: expected x on the weights' device {tensors[0].device}, "
            f"got {x.device}"
        )
    return kernel(x, *tensors, **kwargs)


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
    prepared: PreparedInt4 | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T (+ bias) for compressed-tensors INT4 weights.

    With `prepared` (from `prepare_int4` on these same tensors) the checks and backend choice
    made there are reused; otherwise they run on this call.
    """
    if prepared is not None:
        if prepared.weight_packed is not weight_packed:
            raise ValueError(
                "prepared: expected a PreparedInt4 made from this weight_packed tensor, got one "
                "made from another"
            )
        return prepared(x)
    group_size = _group_size(scheme, in_features)
    check_int4_operands(
        x, weight_packed, weight_scale, weight_zero_point, in_features=in_features,
        group_size=group_size, bias=bias, backend=backend or "int4_linear",
    )  # fmt: skip
    chosen = resolve_backend(x.device, override=backend)
    return _kernel(chosen)(
        x, weight_packed, weight_scale, weight_zero_point, in_features=in_features,
        group_size=group_size, bias=bias, check=False,
    )  # fmt: skip
