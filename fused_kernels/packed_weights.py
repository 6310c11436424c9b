"""Value types for one quantized Linear's stored weights, as every kernel of their kind takes them.

- `PackedInt4`: compressed-tensors pack-quantized INT4: `weight_packed` int32 [N, ceil(K/8)],
  `weight_scale` [N, K/G], `weight_zero_point` int32 [ceil(N/8), K/G] or None (symmetric), with
  `in_features` K and the resolved `group_size` G (K for per channel).
- `PackedFp8`: compressed-tensors float-quantized FP8: `weight` float8_e4m3fn [N, K] and
  `weight_scale` [N, 1].

Both hold references to the layer's tensors (no copies) and are built from a module's tensors
and its scheme (`packed_weights`). The INT4 launchers take the value itself
(`launcher(x, weights, *, bias=...)`); the FP8 ones keep their two loose tensors. Either reaches
its launcher as `launcher(x, *w.launch_args, **w.kernel_args(bias=..., act_dynamic=...))`, the
one place that spelling lives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantkit.errors import SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.checks import check_fp8_weights, check_int4_weights, resolve_group_size

__all__ = ["PackedFp8", "PackedInt4", "PackedWeights", "packed_weights"]


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


@dataclass(frozen=True, eq=False)
class PackedFp8:
    """One layer's FP8 weights."""

    kind: ClassVar[str] = "fp8"
    weight: torch.Tensor
    weight_scale: torch.Tensor

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor | None],
        *,
        scheme: QuantScheme,
        in_features: int | None = None,
    ) -> PackedFp8:
        """From a module's tensors under their checkpoint names (`in_features` is the weight's
        second dimension; taken for a signature shared with `PackedInt4`)."""
        if scheme.kind != cls.kind:
            raise SchemeError(f"fp8_linear: expected an fp8 scheme, got {scheme.describe()}")
        return cls(tensors["weight"], tensors["weight_scale"])

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight, self.weight_scale

    @property
    def launch_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The launchers' positional weight arguments: the two tensors."""
        return self.tensors

    def kernel_args(self, *, bias: torch.Tensor | None, act_dynamic: bool = False) -> dict:
        return dict(act_dynamic=act_dynamic, bias=bias)

    def check(self, *, bias: torch.Tensor | None = None) -> None:
        check_fp8_weights(self.weight, self.weight_scale, bias=bias)

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
        """Bytes a call reads for the weights: the fp8 weight + the scales."""
        return _nbytes(*self.tensors)


PackedWeights = PackedInt4 | PackedFp8
_TYPES: dict[str, type[PackedInt4] | type[PackedFp8]] = {"int4": PackedInt4, "fp8": PackedFp8}


def packed_weights(
    tensors: Mapping[str, torch.Tensor | None], *, scheme: QuantScheme, in_features: int
) -> PackedWeights:
    """The value type of `scheme`'s kind built from a module's tensors (checkpoint names)."""
    return _TYPES[scheme.kind].from_tensors(tensors, scheme=scheme, in_features=in_features)
