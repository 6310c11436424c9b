"""The kernel registry: every quantized-linear kernel in one priority list, and the one chooser.

Each `Kernel` entry says which scheme kinds it serves, the device types it is picked for without
being asked, and why it cannot run a scheme on a device (`can_implement` -> reason, or None when
it can). Its kernel file is imported only once it is tried: choosing never imports what cannot
run (Triton on CPU tensors without the interpreter). Today's entries, per kind in this order:

- `triton`: the fused Triton kernels (`triton.w4a16`, `triton.fp8`), for CUDA tensors, or CPU
  tensors under `TRITON_INTERPRET=1` (tests; fp16/fp32 only). A prepared INT4 layer is a
  `triton.w4a16_columns.TritonInt4Layer`: one activation row through a GEMV on a column copy
  of its words, every other shape through `triton.w4a16`. FP8 W8A8 needs fp8 tensor cores
  (sm_89+); without them a W8A8 layer runs as W8A16 and warns once (`prepared_linear`).
- `cpu`: the compiled C GEMVs + dequantize/MKL prefill (`cpu.w4a16`, `cpu.fp8`); built with gcc
  on first use and cached under $QUANTKIT_HOME. FP8 W8A8 runs with the GPU kernel's numerics.
  INT8 W8A8 (`cpu.int8`): int8 x int8 products for decode and prefill, on CPUs with
  AVX512-VNNI only.
- `reference`: dequantize and matmul in fp32 (`reference.w4a16`, `reference.fp8`); for INT8
  W8A8 the exact integer emulation (`reference.int8`), which the C kernel matches bit for bit;
  runs anywhere, slowly.
- NVFP4 and MXFP4 (`nvfp4`, `mxfp4`): `triton.fp4` (one fused dequant GEMM, checked under the
  interpreter and compiled for sm_90, not yet run on a GPU) and `reference.fp4`; both emulate
  NVFP4 W4A4's activation rounding in torch. The cpu kernels read int32-packed INT4 or whole
  fp8/int8 weights with float scales, not E2M1 nibbles under E4M3 or E8M0 group scales, so they
  refuse these kinds ("serves int4, not nvfp4") and a CPU walk reaches the reference.

`choose_kernel(scheme, device, override)`: the wanted backend is `override`, else
$QUANTKIT_BACKEND, else none (an unknown name raises). The walk starts at the wanted backend's
entry (at the top when none is wanted) and tries, in order, the wanted entry and every later
one picked for this device type (triton: cuda, cpu: cpu, reference: any). The first that can run
wins: CUDA -> triton, CPU -> cpu, anything else -> reference. A tried entry that cannot run warns
one line naming the next one tried (triton -> cpu -> reference; the warnings module shows a given
line once). A wanted entry may refuse instead of falling back (`KernelUnavailableError`): Triton
asked for by name and not installed (naming the extra), cpu asked for on non-CPU tensors. When
nothing fits, one `KernelUnavailableError` lists every kernel's reason.

A new backend: one kernel file (a launcher `f(x, *weights.launch_args,
**weights.kernel_args(...), check=...)`, optionally a class that binds one layer's weights once)
and one entry in `KERNELS`.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from quantkit.cpu import cpu_flags
from quantkit.errors import KernelUnavailableError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.packed_weights import PackedWeights

__all__ = ["BACKENDS", "KERNELS", "Kernel", "choose_kernel", "resolve_backend"]

# (kernel, device, requested) -> why it cannot run, or None; may raise when requested.
Blocker = Callable[["Kernel", torch.device, bool], "str | None"]


def _runs_anywhere(kernel: Kernel, device: torch.device, requested: bool) -> str | None:
    return None


@dataclass(frozen=True)
class Kernel:
    """One registry entry. `module` is a file of `quantkit.fused_kernels`; `launcher` its
    function y = launcher(x, *weights.launch_args, **weights.kernel_args(...)) (INT4: the
    `PackedInt4` itself; FP8: its two tensors); `layer` an optional class binding one layer's
    weights once (layer(*weights.launch_args, **kwargs)(x)); `devices` the device
    types it is picked for unasked (empty: every type); `takes_check` whether the launcher has
    `check=` (prepared calls pass False); `w8a8` a module function(device) -> bool saying where
    it runs W8A8 (None: everywhere)."""

    name: str
    backend: str
    kinds: tuple[str, ...]
    module: str
    launcher: str
    layer: str | None = None
    devices: tuple[str, ...] = ()
    blocker: Blocker = _runs_anywhere
    takes_check: bool = True
    w8a8: str | None = None

    def picked_for(self, scheme: QuantScheme, device: torch.device, requested: bool) -> str | None:
        """Why this entry is not even tried for `scheme` on `device` (None: it is)."""
        if scheme.kind not in self.kinds:
            return f"serves {'/'.join(self.kinds)}, not {scheme.kind}"
        if not requested and self.devices and device.type not in self.devices:
            return (
                f"picked for {'/'.join(self.devices)} tensors only, got {device.type} "
                f"(ask for it with QUANTKIT_BACKEND={self.backend})"
            )
        return None

    def can_implement(
        self, scheme: QuantScheme, device: torch.device | str, *, requested: bool = False
    ) -> str | None:
        """Why this kernel cannot run `scheme` on `device`, or None when it can. `requested`: it
        was asked for by name (it is then tried on any device, and may raise instead)."""
        device = torch.device(device)
        return self.picked_for(scheme, device, requested) or self.blocker(self, device, requested)

    def load(self) -> ModuleType:
        """The kernel file (imported on first use)."""
        return importlib.import_module(f"quantkit.fused_kernels.{self.module}")

    def supports_w8a8(self, device: torch.device) -> bool:
        return self.w8a8 is None or bool(getattr(self.load(), self.w8a8)(torch.device(device)))

    def bind(
        self, weights: PackedWeights, *, bias: torch.Tensor | None, act_dynamic: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The call of one prepared layer, checks done: the weights bound once (`layer`), or the
        launcher without its checks behind a check that x is on the weights' device."""
        kwargs = weights.kernel_args(bias=bias, act_dynamic=act_dynamic)
        module = self.load()
        if self.layer is not None:
            return getattr(module, self.layer)(*weights.launch_args, **kwargs)
        if self.takes_check:
            kwargs["check"] = False
        kernel = functools.partial(getattr(module, self.launcher), **kwargs)
        return functools.partial(_on_device, kernel, self.backend, weights)

    def launch(
        self,
        x: torch.Tensor,
        weights: PackedWeights,
        *,
        bias: torch.Tensor | None,
        act_dynamic: bool = False,
    ) -> torch.Tensor:
        """One unprepared call of the launcher on operands the caller has checked."""
        kwargs = weights.kernel_args(bias=bias, act_dynamic=act_dynamic)
        if self.takes_check:
            kwargs["check"] = False
        return getattr(self.load(), self.launcher)(x, *weights.launch_args, **kwargs)


def _on_device(
    kernel: Callable[..., torch.Tensor],
    backend: str,
    weights: PackedWeights,
    x: torch.Tensor,
) -> torch.Tensor:
    device = weights.device
    if x.device != device:
        raise KernelUnavailableError(
            f"{backend} backend: expected x on the weights' device {device}, got {x.device}"
        )
    return kernel(x, *weights.launch_args)


# --------------------------------------------------------------------------- blockers


def triton_blocker(kernel: Kernel, device: torch.device, requested: bool) -> str | None:
    """Triton runs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; the device is checked
    before anything is imported. Asked for by name and not installed: raises."""
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
    elif device.type != "cuda":
        return f"triton does not run on {device.type} tensors"
    try:
        module = kernel.load()
    except ImportError as exc:
        if requested:
            raise KernelUnavailableError(
                f"triton backend: expected the triton package, got ImportError ({exc}); "
                "install it with: pip install 'quantkit[kernels]'"
            ) from exc
        return "the triton package is not installed (pip install 'quantkit[kernels]')"
    if os.environ.get("TRITON_INTERPRET") == "1" and not module.is_interpreted():
        return "TRITON_INTERPRET=1 was set after the Triton kernels were imported"
    return None


def compiled_blocker(available: str) -> Blocker:
    """A C kernel: CPU tensors only (asked for on others: raises), and it must build here
    (`available`, a function of the kernel file, builds it on first call)."""

    def blocker(kernel: Kernel, device: torch.device, requested: bool) -> str | None:
        if device.type != "cpu":
            if requested:
                raise KernelUnavailableError(
                    f"{kernel.backend} backend: expected CPU tensors, got {device} "
                    f"(unset QUANTKIT_BACKEND={kernel.backend})"
                )
            return f"expected CPU tensors, got {device}"
        if getattr(kernel.load(), available)():
            return None
        return "the C kernel did not build (is gcc installed?)"

    return blocker


def vnni_blocker(available: str) -> Blocker:
    """A C kernel of int8 x int8 products (vpdpbusd): `compiled_blocker`, and on a CPU without
    AVX512-VNNI that reason (the reference then runs the same numerics)."""
    compiled = compiled_blocker(available)

    def blocker(kernel: Kernel, device: torch.device, requested: bool) -> str | None:
        if device.type == "cpu" and "avx512_vnni" not in cpu_flags():
            return "needs a CPU with AVX512-VNNI (int8 dot products), this one has none"
        return compiled(kernel, device, requested)

    return blocker


# --------------------------------------------------------------------------- the registry

KERNELS: tuple[Kernel, ...] = (
    Kernel("triton-int4", "triton", ("int4",), "triton.w4a16_columns", "w4a16_linear_triton",
           layer="TritonInt4Layer", devices=("cuda",), blocker=triton_blocker),
    Kernel("triton-fp8", "triton", ("fp8",), "triton.fp8", "fp8_linear_triton",
           devices=("cuda",), blocker=triton_blocker, w8a8="fp8_dot_supported"),
    Kernel("triton-nvfp4", "triton", ("nvfp4",), "triton.fp4", "fp4_linear_triton",
           devices=("cuda",), blocker=triton_blocker),
    Kernel("triton-mxfp4", "triton", ("mxfp4",), "triton.fp4", "fp4_linear_triton",
           devices=("cuda",), blocker=triton_blocker),
    Kernel("cpu-int4", "cpu", ("int4",), "cpu.w4a16", "w4a16_linear_cpu", layer="CpuInt4Layer",
           devices=("cpu",), blocker=compiled_blocker("cpu_kernel_available")),
    Kernel("cpu-fp8", "cpu", ("fp8",), "cpu.fp8", "fp8_linear_cpu", layer="CpuFp8Layer",
           devices=("cpu",), blocker=compiled_blocker("fp8_cpu_available")),
    Kernel("cpu-int8", "cpu", ("int8",), "cpu.int8", "int8_linear_cpu", layer="CpuInt8Layer",
           devices=("cpu",), blocker=vnni_blocker("int8_cpu_available")),
    Kernel("reference-int4", "reference", ("int4",), "reference.w4a16", "w4a16_linear_reference",
           takes_check=False),
    Kernel("reference-fp8", "reference", ("fp8",), "reference.fp8", "fp8_linear_reference",
           takes_check=False),
    Kernel("reference-int8", "reference", ("int8",), "reference.int8", "int8_linear_reference",
           takes_check=False),
    Kernel("reference-nvfp4", "reference", ("nvfp4",), "reference.fp4", "fp4_linear_reference",
           takes_check=False),
    Kernel("reference-mxfp4", "reference", ("mxfp4",), "reference.fp4", "fp4_linear_reference",
           takes_check=False),
)  # fmt: skip
BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(k.backend for k in KERNELS))


def _warn_fallback(wanted: str, used: str, reason: str) -> None:
    # One line, identical for every layer and attributed to one line of choose_kernel, so the
    # warnings registry shows it once.
    warnings.warn(
        f"quantkit: {wanted} backend unavailable ({reason}); using {used}",
        RuntimeWarning,
        stacklevel=2,
    )


def choose_kernel(
    scheme: QuantScheme,
    device: torch.device | str,
    override: str | None = None,
    *,
    kernels: Sequence[Kernel] | None = None,
) -> Kernel:
    """The kernel that runs `scheme` on `device`, after fallbacks (each warns once); see the
    module docstring. `kernels`: the priority list (default `KERNELS`; tests pass their own)."""
    kernels = KERNELS if kernels is None else kernels
    device = torch.device(device)
    wanted = override or os.environ.get("QUANTKIT_BACKEND") or None
    backends = tuple(dict.fromkeys(k.backend for k in kernels))
    if wanted is not None and wanted not in backends:
        raise KernelUnavailableError(
            f"backend: expected one of {', '.join(backends)} (argument or QUANTKIT_BACKEND), "
            f"got {wanted!r}"
        )
    reasons: list[str] = []
    failed: tuple[Kernel, str] | None = None  # the last tried kernel, when it could not run
    reached = wanted is None
    for kernel in kernels:
        requested = not reached and kernel.backend == wanted and scheme.kind in kernel.kinds
        reached = reached or requested
        reason = kernel.picked_for(scheme, device, requested)
        if reason is None and not reached:
            reason = f"{wanted} was asked for"
        if reason is None:  # tried
            if failed is not None:
                _warn_fallback(failed[0].backend, kernel.backend, failed[1])
            reason = kernel.blocker(kernel, device, requested)
            if reason is None:
                return kernel
            failed = (kernel, reason)
        reasons.append(f"{kernel.name}: {reason}")
    raise KernelUnavailableError(
        f"no kernel runs {scheme.kind} weights on {device} tensors ({'; '.join(reasons)})"
    )


def resolve_backend(
    device: torch.device | str, *, override: str | None = None, kind: str = "int4"
) -> str:
    """The backend that runs `kind` layers on `device`, after fallbacks (each warns once)."""
    return choose_kernel(QuantScheme(kind), device, override).backend
