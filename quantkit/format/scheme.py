"""`QuantScheme`: the one description of a quantization that travels everywhere.

The quantizer builds it, the checkpoint writer serialises it into compressed-tensors metadata,
the loader rebuilds it, `QuantLinear` carries it and the kernel dispatch reads it. It is never a
dict and never encoded in a filename.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from quantkit.errors import SchemeError

Method = Literal["awq", "rtn", "fp8"]
ActivationScheme = Literal["none", "dynamic"]
Rounding = Literal["nearest", "gptq"]

METHODS: tuple[str, ...] = ("awq", "rtn", "fp8")
ROUNDINGS: tuple[str, ...] = ("nearest", "gptq")
INT_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, -1)
# Largest first: `auto` picks the largest that divides every layer (fewer scales to read).
AUTO_CANDIDATES: tuple[int, ...] = (128, 64, 32)


@dataclass(frozen=True)
class QuantScheme:
    """How the weights of every quantized Linear are stored.

    method: `awq` or `rtn` (INT4, group-wise) or `fp8` (E4M3, per output channel).
    bits: 4 for the integer methods, 8 for fp8.
    group_size: 32/64/128 input channels share one scale (and zero point); -1 = one per output
        channel; "auto" until `resolve()` picks one for a concrete model. Always -1 for fp8.
    symmetric: INT4 without zero points (codes in [-7, 7]); fp8 is always symmetric.
    activations: fp8 only: "none" keeps activations in 16/32-bit (W8A16), "dynamic" quantizes
        them per token at run time (W8A8).
    rounding: how the codes were chosen on the fixed scales: "nearest" (round to nearest, no
        calibration) or "gptq" (error-compensated over calibration inputs; fp8 only for now).
        The tensors and the compressed-tensors config are the same either way: only the codes
        differ, and quantkit.json records which rounding made them.
    """

    method: Method = "awq"
    bits: int = 4
    group_size: int | Literal["auto"] = "auto"
    symmetric: bool = False
    activations: ActivationScheme = "none"
    rounding: Rounding = "nearest"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SchemeError(f"method: expected one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "fp8":
            if self.bits != 8:
                raise SchemeError(f"bits: fp8 stores 8 bits, got {self.bits}")
            if self.group_size not in (-1, "auto"):
                raise SchemeError(
                    f"group_size: fp8 uses one scale per output channel (-1), got {self.group_size}"
                )
            # fp8 is per channel by definition; normalise so equal schemes compare equal.
            object.__setattr__(self, "group_size", -1)
            object.__setattr__(self, "symmetric", True)
        else:
            if self.bits != 4:
                raise SchemeError(
                    f"bits: {self.method} quantizes to 4 bits (use --bits 8 for fp8), "
                    f"got {self.bits}"
                )
            if self.group_size != "auto" and self.group_size not in INT_GROUP_SIZES:
                raise SchemeError(
                    "group_size: expected auto, 32, 64, 128 or -1 (per channel), "
                    f"got {self.group_size!r}"
                )
            if self.activations != "none":
                raise SchemeError(
                    f"activations: only fp8 quantizes activations, got {self.activations!r} "
                    f"with {self.method}"
                )
        if self.activations not in ("none", "dynamic"):
            raise SchemeError(
                f"activations: expected 'none' or 'dynamic', got {self.activations!r}"
            )
        if self.rounding not in ROUNDINGS:
            raise SchemeError(
                f"rounding: expected one of {', '.join(ROUNDINGS)}, got {self.rounding!r}"
            )
        if self.rounding == "gptq" and self.method != "fp8":
            raise SchemeError(
                f"rounding: gptq is implemented for fp8 (8 bits) only, got {self.method} int4"
            )

    @property
    def is_int(self) -> bool:
        return self.method in ("awq", "rtn")

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
                if k % self.group_size:
                    raise SchemeError(
                        f"group_size {self.group_size} does not divide in_features {k} of "
                        f"{name}; expected a divisor such as "
                        f"{_divisors_hint(k)} or auto"
                    )
        return self

    def groups(self, in_features: int) -> int:
        """Number of scale groups along K for a layer with `in_features` inputs."""
        if self.group_size == "auto":
            raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
        return 1 if self.group_size == -1 else in_features // self.group_size

    def describe(self) -> str:
        """One human line, e.g. 'awq int4 g64 asymmetric'."""
        if self.method == "fp8":
            act = "W8A8 dynamic per-token" if self.activations == "dynamic" else "W8A16"
            rounding = ", GPTQ rounding" if self.rounding == "gptq" else ""
            return f"fp8 e4m3 per-channel ({act}{rounding})"
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.method} int4 {group} {kind}"


def _divisors_hint(k: int) -> str:
    good = [str(g) for g in (32, 64, 128) if k % g == 0]
    return ", ".join(good) if good else "-1"
