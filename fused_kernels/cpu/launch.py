"""What the CPU launchers (`w4a16`, `fp8`, `bf16_gemv`) share around their compiled
C kernels.

- `library_loader(name)`: the loader of one library of `abi` (built on first use, loaded
  once per variant), and `loads(library)`: whether it builds and loads here.
- `check_status`: the kernels' return values (`csrc/quantkit_kernels.h`) as exceptions.
- `rows_stride`: a tensor with unit stride along its last dim (the kernels index rows by stride).
- `int8_block`, `interleave16`: the int8 tiles' activation block and weight layout (16 rows
  interleaved), for the INT4 GEMV and the int8 head alike.
- `BoundGemvLayer`: the call of one linear bound to its C GEMV once (`CpuInt4Layer`,
  `CpuFp8Layer`): per call only x and the output are passed; what the GEMV does not take goes
  to the layer's launcher, unbound.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.cpu import abi as cpu_abi
from quantkit.fused_kernels.cpu.build import DTYPE_CODES


def int8_block(group: int, in_features: int) -> int:
    """The int8 tiles' activation block (csrc/w4a16.c `i8_block`): the largest of 128, 64 and
    32 elements dividing the group (a row's K with one group per row) and K; 0 when none does
    (the tile does not apply)."""
    return next((a for a in (128, 64, 32) if group % a == 0 and in_features % a == 0), 0)


def interleave16(t: torch.Tensor, *, fill: int = 0, tiles_at_once: int = 4096) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16] contiguous: element (j, l) of tile i is t[16 i + l, j];
    rows past N hold `fill`. Written `tiles_at_once` tiles at a time, so a large t (an 8B
    model's int8 head) needs no padded copy of itself."""
    n, c = t.shape
    out = t.new_empty((n + 15) // 16, c, 16)
    for i in range(0, out.shape[0], tiles_at_once):
        part = t[16 * i : 16 * (i + tiles_at_once)]
        pad = -part.shape[0] % 16
        if pad:
            part = torch.cat([part, part.new_full((pad, c), fill)])
        out[i : i + part.shape[0] // 16] = part.view(-1, 16, c).transpose(1, 2)
    return out


def library_loader(name: str) -> Callable[..., ctypes.CDLL]:
    """library(variant=None): library `name` of `abi` for `variant` (default: the best this
    CPU runs), built on first use (one gcc call, cached on disk); functools.cache keeps the
    loaded handle, not tensors."""

    @functools.cache
    def library(variant: str | None = None) -> ctypes.CDLL:
        return cpu_abi.load(name, variant=variant)

    return library


def loads(library: Callable[[], ctypes.CDLL]) -> bool:
    """True if `library` builds and loads here (builds it on first call)."""
    try:
        library()
    except KernelUnavailableError:
        return False
    return True


def check_status(status: int, what: str) -> None:
    """Raise for a kernel's nonzero return value: 1 = unsupported group layout (the INT4
    kernels), else a failed scratch allocation."""
    if status == 1:
        raise ValueError(f"{what}: expected a group size that is a multiple of 32 or per-channel")
    if status != 0:
        raise MemoryError(f"{what}: expected a scratch buffer, got allocation failure ({status})")


def rows_stride(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (the kernels index rows by stride only)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def require_cpu(t: torch.Tensor) -> None:
    """Raise unless t is on the CPU."""
    if t.device.type != "cpu":
        raise KernelUnavailableError(f"cpu backend: expected CPU tensors, got {t.device}")


class BoundGemvLayer:
    """One linear bound to its C GEMV once. A subclass names the GEMV in `gemv` (for errors),
    calls `_bind` in its __init__ and `_gemv` in its __call__, with the GEMV's arguments that
    follow the output's (if any).

    Holds references to the tensors it was built from (their memory stays valid); build a new
    one if the layer's tensors are replaced. Pickles and deep-copies by rebuilding from the
    (copied) tensors: the ctypes struct holds raw pointers, which neither can copy.
    """

    gemv: ClassVar[str]
    in_features: int
    out_features: int
    variant: str | None

    def _bind(
        self,
        launcher: Callable[..., torch.Tensor],
        tensors: tuple,
        kwargs: dict[str, Any],
        *,
        variant: str | None,
        layer: ctypes.Structure,
        fn: Callable[..., int],
        max_m: int,
        max_m_bf16: int,
    ) -> None:
        """`launcher(x, *tensors, **kwargs, check=False, variant=variant)` runs a call the
        GEMV does not take (`tensors`: the launcher's positional weight arguments, a
        `PackedInt4` or the FP8 tensors); `fn(layer, ...)` is the GEMV, which takes at most
        `max_m` rows (`max_m_bf16` for bf16 activations)."""
        self.tensors, self.variant = tensors, variant
        self._launcher, self._kwargs = launcher, kwargs
        self._layer, self._fn = layer, fn
        self._max_m, self._max_m_bf16 = max_m, max_m_bf16

    def __reduce__(self) -> tuple:
        return (_rebuild, (type(self), self.tensors, self._kwargs, self.variant))

    def _gemv(self, x: torch.Tensor, *extra: int) -> torch.Tensor:
        if not x.is_cpu:
            raise KernelUnavailableError(f"cpu backend: expected CPU tensors, got {x.device}")
        n = self.out_features
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        m = x2.shape[0]
        max_m = self._max_m_bf16 if x.dtype == torch.bfloat16 else self._max_m
        if m > max_m or m == 0 or x2.stride(-1) != 1:
            return self._launcher(
                x, *self.tensors, **self._kwargs, check=False, variant=self.variant
            )
        out = torch.empty(m, n, dtype=x.dtype)
        code = DTYPE_CODES[x.dtype]
        status = self._fn(
            self._layer, x2.data_ptr(), code, m, x2.stride(0), out.data_ptr(), code, n, *extra,
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            check_status(status, self.gemv)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def _rebuild(
    cls: type[BoundGemvLayer], tensors: tuple, kwargs: dict[str, Any], variant: str | None
) -> BoundGemvLayer:
    return cls(*tensors, **kwargs, variant=variant)


def best_pointer(best: torch.Tensor | None, rows: int) -> int | None:
    """The address of `best` (int64 [rows, QK_TOP], contiguous, on the CPU) for a head GEMV's
    best tokens, or None; ValueError for anything else."""
    if best is None:
        return None
    top = cpu_abi.QK_TOP
    if (
        best.dtype != torch.int64
        or tuple(best.shape) != (rows, top)
        or not best.is_contiguous()
        or not best.is_cpu
    ):
        raise ValueError(f"best: expected int64 [{rows}, {top}] on the CPU, got {best.dtype} "
                         f"{tuple(best.shape)} on {best.device}")  # fmt: skip
    return best.data_ptr()
