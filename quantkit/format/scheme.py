"""`QuantScheme`: what the checkpoint stores, the one description that travels everywhere.

The quantizer builds it, the checkpoint writer serialises it into compressed-tensors metadata,
the loader rebuilds it, `QuantLinear` carries it and the kernel registry reads it. It is never a
dict and never encoded in a filename.

It describes the *format* only. The algorithm that chose the codes (rtn, awq, gptq: see
`quantkit.quantize.algorithms`) is a separate axis: the same format can come from any algorithm
that supports it, and the checkpoint records the algorithm as provenance in quantkit.json.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from quantkit.errors import SchemeError
from quantkit.format.formats import format_for
from quantkit.format.weight_format import WeightFormat

ActivationScheme = Literal["none", "dynamic"]

# Largest first: `auto` picks the largest that divides every layer (fewer scales to read).
AUTO_CANDIDATES: tuple[int, ...] = (128, 64, 32)


@dataclass(frozen=True)
class QuantScheme:
    """How the weights of every quantized Linear are stored.

    kind: a format of `quantkit.format.formats`: `int4` (group-wise codes with scales, and zero
        points unless symmetric), `fp8` (E4M3 with one scale per output channel) or `int8`
        (int8 codes with one scale per output channel, W8A8).
    group_size: 32/64/128 input channels share one scale (and zero point); -1 = one per output
        channel; "auto" until `resolve()` picks one for a concrete model. Always -1 for fp8
        and int8.
    symmetric: INT4 without zero points (codes in [-7, 7]); fp8 is always symmetric.
    activations: "none" keeps activations in 16/32-bit (W8A16), "dynamic" quantizes them per
        token at run time (W8A8): a choice for fp8, always "dynamic" for int8, "none" for int4.
    """

    kind: str = "int4"
    group_size: int | Literal["auto"] = "auto"
    symmetric: bool = False
    activations: ActivationScheme = "none"

    def __post_init__(self) -> None:
        fmt = format_for(self.kind)
        if self.activations not in ("none", "dynamic"):
            raise SchemeError(
                f"activations: expected 'none' or 'dynamic', got {self.activations!r}"
            )
        for field, value in fmt.normalized(self).items():
            object.__setattr__(self, field, value)

    @property
    def format(self) -> WeightFormat:
        """Everything about how this scheme's weights are stored (`quantkit.format.formats`)."""
        return format_for(self.kind)

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def is_resolved(self) -> bool:
        return self.group_size != "auto"

    def resolve(self, in_features: Iterable[tuple[str, int]]) -> QuantScheme:
        """Fix `auto` and check the group size against every layer's in_features.

        `in_features` is (layer name, in_features) for each Linear to quantize. An explicit
        group size that does not divide a layer is an error naming that layer.
        """
        layers = list(in_features)
        if not layers:
            raise SchemeError("expected at least one Linear layer to quantize, got none")
        if self.group_size == "auto":
            for candidate in AUTO_CANDIDATES:
                if all(k % candidate == 0 for _, k in layers):
                    return replace(self, group_size=candidate)
            name, k = next((n, k) for n, k in layers if k % AUTO_CANDIDATES[-1])
            raise SchemeError(
                f"group_size auto: no group size in {AUTO_CANDIDATES} divides {name} "
                f"(in_features {k}); pass --group-size -1 for per-channel scales"
            )
        if self.group_size > 0:
            for name, k in layers:
                if k % self.group_size and self.format.fixed_group:
                    raise SchemeError(
                        f"{self.kind} needs every quantized Linear's in_features to be a "
                        f"multiple of its group of {self.group_size}, got {k} for {name}; "
                        f"this model needs another format (int4 or fp8)"
                    )
                if k % self.group_size:
                    raise SchemeError(
                        f"group_size {self.group_size} does not divide in_features {k} of "
                        f"{name}; expected a divisor such as "
                        f"{_divisors_hint(k)} or auto"
                    )
        return self

    def group_size_for(self, in_features: int) -> int:
        """The concrete group size for a layer with `in_features` inputs: -1 (one group per
        output channel) is K. The one place that rule lives."""
        if self.group_size == "auto":
            raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
        return in_features if self.group_size == -1 else int(self.group_size)

    def groups(self, in_features: int) -> int:
        """Number of scale groups along K for a layer with `in_features` inputs."""
        return in_features // self.group_size_for(in_features)

    def describe(self, algorithm: str | None = None) -> str:
        """One human line, e.g. 'int4 g64 asymmetric', or with the algorithm that chose the
        codes 'awq int4 g64 asymmetric' / 'fp8 e4m3 per-channel (W8A16, gptq)'."""
        return self.format.describe(self, algorithm)

    def to_json(self) -> dict[str, object]:
        """The fields quantkit.json stores (`from_json` reads them back)."""
        return {
            "kind": self.kind,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "activations": self.activations,
        }

    @classmethod
    def from_json(cls, fields: dict[str, object]) -> QuantScheme:
        return cls(**{k: fields[k] for k in ("kind", "group_size", "symmetric", "activations")})  # type: ignore[arg-type]


def _divisors_hint(k: int) -> str:
    good = [str(g) for g in (32, 64, 128) if k % g == 0]
    return ", ".join(good) if good else "-1"
