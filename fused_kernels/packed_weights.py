"""Value types for one quantized Linear's stored weights, as every kernel of their kind takes them.

- `PackedInt4`: compressed-tensors pack-quantized INT4: `weight_packed` int32 [N, ceil(K/8)],
  `weight_scale` [N, K/G], `weight_zero_point` int32 [ceil(N/8), K/G] or None (symmetric), with
  `in_features` K and the resolved `group_size` G (K for per channel).
- `PackedFp8`: compressed-tensors float-quantized FP8: `weight` float8_e4m3fn [N, K] and
  `weight_scale` [N, 1].
- `PackedInt8`: compressed-tensors int-quantized INT8 (W8A8): `weight` int8 [N, K] and
  `weight_scale` [N, 1]; the activations are always quantized per token.
- `PackedFp4`: compressed-tensors nvfp4-/mxfp4-pack-quantized: `weight_packed` uint8 [N, K/2],
  `weight_scale` [N, K/16] float8_e4m3fn or [N, K/32] uint8, nvfp4's float32 global scales.

Both hold references to the layer's tensors (no copies) and are built from a module's tensors
and its scheme (`packed_weights`). The INT4 launchers take the value itself
(`launcher(x, weights, *, bias=...)`); the FP8 ones keep their two loose tensors. Either reaches
its launcher as `launcher(x, *w.launch_args, **w.kernel_args(bias=..., act_dynamic=...))`, the
one place that spelling lives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Self

import torch

from quantkit.errors import SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.checks import (
    SCALE_DTYPES,
    check_fp8_weights,
    check_int4_weights,
    check_int8_weights,
    resolve_group_size,
)

__all__ = ["PackedFp4", "PackedFp8", "PackedInt4", "PackedInt8", "PackedWeights", "packed_weights"]

# The dtype of `weight_scale` per FP4 kind.
FP4_SCALES: dict[str, torch.dtype] = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True, eq=False)
class PackedInt4:
    """One layer's INT4 weights; `group_size` is resolved (in_features for per channel)."""

    kind: ClassVar[str] = "int4"
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    in_features: int
    group_size: int

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor | None],
        *,
        scheme: QuantScheme,
        in_features: int,
    ) -> PackedInt4:
        """From a module's tensors under their checkpoint names (extra names are ignored)."""
        if scheme.kind != cls.kind:
            raise SchemeError(f"int4_linear: expected an INT4 scheme, got {scheme.describe()}")
        group_size = resolve_group_size(scheme.group_size_for(in_features), in_features)
        return cls(
            tensors["weight_packed"],
            tensors["weight_scale"],
            tensors.get("weight_zero_point"),
            in_features,
            group_size,
        )

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The weight tensors: packed ints, scales, zero points (or None)."""
        return self.weight_packed, self.weight_scale, self.weight_zero_point

    @property
    def launch_args(self) -> tuple[PackedInt4]:
        """The launchers' positional weight arguments: this value."""
        return (self,)

    def kernel_args(self, *, bias: torch.Tensor | None, act_dynamic: bool = False) -> dict:
        """The launchers' keyword arguments. INT4 has no activation quantization (a scheme with
        it is refused by `QuantScheme`), so `act_dynamic` is always False here."""
        return dict(bias=bias)

    def check(self, *, bias: torch.Tensor | None = None) -> None:
        """Raise unless these tensors (and `bias`) form one valid INT4 linear."""
        check_int4_weights(self, bias=bias)

    @property
    def device(self) -> torch.device:
        return self.weight_packed.device

    @property
    def out_features(self) -> int:
        return self.weight_packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a call reads for the weights: packed ints + scales + zero points."""
        return _nbytes(*self.tensors)


class _PerRowWeights:
    """What `PackedFp8` and `PackedInt8` share: `weight` [N, K] holding the codes and
    `weight_scale` [N, 1], the two tensors the launchers take first."""

    kind: ClassVar[str]
    weight: torch.Tensor
    weight_scale: torch.Tensor

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor | None],
        *,
        scheme: QuantScheme,
        in_features: int | None = None,
    ) -> Self:
        """From a module's tensors under their checkpoint names (`in_features` is the weight's
        second dimension; taken for a signature shared with `PackedInt4`)."""
        if scheme.kind != cls.kind:
            raise SchemeError(
                f"{cls.kind}_linear: expected an {cls.kind} scheme, got {scheme.describe()}"
            )
        return cls(tensors["weight"], tensors["weight_scale"])  # type: ignore[call-arg]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight, self.weight_scale

    @property
    def launch_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The launchers' positional weight arguments: the two tensors."""
        return self.tensors

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a call reads for the weights: the codes + the scales."""
        return _nbytes(*self.tensors)


@dataclass(frozen=True, eq=False)
class PackedFp8(_PerRowWeights):
    """One layer's FP8 weights."""

    kind: ClassVar[str] = "fp8"
    weight: torch.Tensor
    weight_scale: torch.Tensor

    def kernel_args(self, *, bias: torch.Tensor | None, act_dynamic: bool = False) -> dict:
        return dict(act_dynamic=act_dynamic, bias=bias)

    def check(self, *, bias: torch.Tensor | None = None) -> None:
        check_fp8_weights(self.weight, self.weight_scale, bias=bias)


@dataclass(frozen=True, eq=False)
class PackedInt8(_PerRowWeights):
    """One layer's INT8 W8A8 weights. Its launchers take the two tensors and `bias`; there is
    no `act_dynamic`: the activations are always quantized (the format is W8A8 only)."""

    kind: ClassVar[str] = "int8"
    weight: torch.Tensor
    weight_scale: torch.Tensor

    def kernel_args(self, *, bias: torch.Tensor | None, act_dynamic: bool = True) -> dict:
        return dict(bias=bias)

    def check(self, *, bias: torch.Tensor | None = None) -> None:
        check_int8_weights(self.weight, self.weight_scale, bias=bias)


@dataclass(frozen=True, eq=False)
class PackedFp4:
    """One layer's NVFP4 or MXFP4 weights (`quantkit.format.nvfp4`, `.mxfp4`): `weight_packed`
    uint8 [N, K/2] (two E2M1 codes a byte), `weight_scale` [N, K/G] (float8_e4m3fn for nvfp4,
    uint8 E8M0 exponents for mxfp4), for nvfp4 `weight_global_scale` float32 [1] and, W4A4,
    `input_global_scale` float32 [1]. One type for both: `kind` is a field, not a class
    constant. The launchers take the value itself, `bias` and `act_dynamic`."""

    kind: str
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor | None
    input_global_scale: torch.Tensor | None
    group_size: int

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor | None],
        *,
        scheme: QuantScheme,
        in_features: int | None = None,
    ) -> PackedFp4:
        """From a module's tensors under their checkpoint names (extra names are ignored)."""
        if scheme.kind not in FP4_SCALES:
            raise SchemeError(
                f"fp4_linear: expected an nvfp4/mxfp4 scheme, got {scheme.describe()}"
            )
        return cls(
            scheme.kind,
            tensors["weight_packed"],  # type: ignore[arg-type]
            tensors["weight_scale"],  # type: ignore[arg-type]
            tensors.get("weight_global_scale"),
            tensors.get("input_global_scale"),
            int(scheme.group_size),
        )

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (
            self.weight_packed,
            self.weight_scale,
            self.weight_global_scale,
            self.input_global_scale,
        )

    @property
    def launch_args(self) -> tuple[PackedFp4]:
        """The launchers' positional weight arguments: this value."""
        return (self,)

    def kernel_args(self, *, bias: torch.Tensor | None, act_dynamic: bool = False) -> dict:
        return dict(bias=bias, act_dynamic=act_dynamic)

    def check(self, *, bias: torch.Tensor | None = None) -> None:
        """Raise unless these tensors (and `bias`) form one valid FP4 linear."""
        packed, scale = self.weight_packed, self.weight_scale
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(
                f"weight_packed: expected a 2-D uint8 tensor [N, K/2], got {packed.dtype} "
                f"{tuple(packed.shape)}"
            )
        n, k = packed.shape[0], 2 * packed.shape[1]
        want = (n, k // self.group_size)
        if k % self.group_size or scale.dtype != FP4_SCALES[self.kind] or scale.shape != want:
            raise ValueError(
                f"weight_scale: expected {FP4_SCALES[self.kind]} {list(want)} ({self.kind}, "
                f"K={k}), got {scale.dtype} {list(scale.shape)}"
            )
        globals_ = {"weight_global_scale": self.weight_global_scale}
        if self.input_global_scale is not None:
            globals_["input_global_scale"] = self.input_global_scale
        for name, t in globals_.items():
            if self.kind != "nvfp4":
                if t is not None:
                    raise ValueError(f"{name}: expected none for {self.kind}, got a tensor")
            elif t is None or t.dtype != torch.float32 or t.shape != (1,):
                got = "none" if t is None else f"{t.dtype} {list(t.shape)}"
                raise ValueError(f"{name}: expected a float32 [1] tensor, got {got}")
        if bias is not None and (bias.shape != (n,) or bias.dtype not in SCALE_DTYPES):
            raise ValueError(
                f"bias: expected a float [{n}] tensor, got {bias.dtype} {tuple(bias.shape)}"
            )
        for name, t in (("weight_scale", scale), *globals_.items(), ("bias", bias)):
            if t is not None and t.device != packed.device:
                raise ValueError(
                    f"{name}: expected weight_packed's device {packed.device}, got {t.device}"
                )

    @property
    def device(self) -> torch.device:
        return self.weight_packed.device

    @property
    def in_features(self) -> int:
        return 2 * self.weight_packed.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight_packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a call reads for the weights: packed codes + scales (+ global scales)."""
        return _nbytes(*self.tensors)


PackedWeights = PackedInt4 | PackedFp8 | PackedInt8 | PackedFp4
_TYPES: dict[str, type[PackedInt4] | type[PackedFp8] | type[PackedInt8] | type[PackedFp4]] = {
    "int4": PackedInt4,
    "fp8": PackedFp8,
    "int8": PackedInt8,
    "nvfp4": PackedFp4,
    "mxfp4": PackedFp4,
}


def packed_weights(
    tensors: Mapping[str, torch.Tensor | None], *, scheme: QuantScheme, in_features: int
) -> PackedWeights:
    """The value type of `scheme`'s kind built from a module's tensors (checkpoint names)."""
    return _TYPES[scheme.kind].from_tensors(tensors, scheme=scheme, in_features=in_features)
