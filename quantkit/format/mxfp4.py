"""MXFP4 (OCP Microscaling v1.0): E2M1 codes in groups of 32 sharing one E8M0 scale, a power of
two: compressed-tensors `mxfp4-pack-quantized` (preset MXFP4A16), weights only.

One quantized Linear W [N, K] stores `weight_packed` uint8 [N, K/2] (`quantkit.format.fp4`) and
`weight_scale` uint8 [N, K/32]: the biased exponent e, scale 2^(e - 127) (e = 255 is NaN, never
written and refused on read). W = value(code) * 2^(e - 127), exact in fp32.

The scale is the OCP rule: X = 2^(floor(log2(absmax(group))) - 2), 2 being E2M1's largest
exponent (6 = 1.5 * 2^2), clamped to E8M0's 2^-127 .. 2^127 (an all-zero group: 2^-127); codes
= E2M1(W / X), saturating at 6, so a group's largest values (absmax / X in [4, 8)) may clip to
6. compressed-tensors' own quantizer (`generate_mx_scales`) rounds absmax's mantissa first and
takes the next power of two when it is 1.75 or more; readers see only the stored exponent, so
both read alike (tests/test_fp4_formats.py pins where the two rules differ).

Activations: MXFP4 W4A4 (compressed-tensors' `MXFP4` preset) is not read or written here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.fp4 import Fp4Format, e2m1_codes, fp4_dequantize, grouped, pack_fp4, unpack_fp4
from quantkit.format.weight_format import Codes, SchemeView, Tensors, expect

GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_EMAX = 2  # floor(log2(6))
_LOCAL_NAMES = frozenset({"weight_packed", "weight_scale"})

WEIGHTS: dict[str, Any] = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": GROUP,
    "strategy": "group",
    "dynamic": False,
    "scale_dtype": "torch.uint8",
}


def mx_exponents(x: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/32]: each group's shared exponent by the OCP rule, in [-127, 127]."""
    absmax = grouped(x.float(), GROUP).abs().amax(dim=-1)
    _, e = torch.frexp(absmax)  # absmax = m * 2^e, m in [0.5, 1): floor(log2(absmax)) = e - 1
    exponent = torch.where(absmax > 0, e - 1 - E2M1_EMAX, -E8M0_BIAS)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def e8m0_values(biased: torch.Tensor) -> torch.Tensor:
    """fp32 2^(e - 127) of biased exponents in [0, 254], exactly (2^-127 is an fp32 subnormal):
    built from the bits, not computed."""
    e = biased.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (uint8 codes [..., K], uint8 biased exponents [..., K/32])."""
    biased = (mx_exponents(x) + E8M0_BIAS).to(torch.uint8)
    quotient = grouped(x.float(), GROUP) / e8m0_values(biased).unsqueeze(-1)
    return e2m1_codes(quotient).reshape(x.shape), biased


def mxfp4_dequantize(codes: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] = value(code) * 2^(e - 127)."""
    return fp4_dequantize(codes, e8m0_values(biased), GROUP)


class Mxfp4Format(Fp4Format):
    kind = "mxfp4"
    group = GROUP
    scale_dtype = torch.uint8
    dynamic_activations = False
    ct_formats = ("mxfp4-pack-quantized",)

    def normalized(self, scheme: SchemeView) -> dict[str, Any]:
        if scheme.activations != "none":
            raise SchemeError(
                f"activations: mxfp4 here is weight-only (W4A16), expected 'none', "
                f"got {scheme.activations!r}"
            )
        return {"group_size": self._group_size(scheme), "symmetric": True}

    def describe(self, scheme: SchemeView, algorithm: str | None) -> str:
        return f"mxfp4 e2m1 g32 e8m0 (W4A16{f', {algorithm}' if algorithm else ''})"

    # ---------------------------------------------------------------- compressed-tensors

    def config_entries(self, scheme: SchemeView) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return dict(WEIGHTS), None

    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        if fmt not in self.ct_formats:
            raise CheckpointError(
                f"quantization_config.{where}.format: expected {self.ct_formats[0]!r} for "
                f"group float weights, got {fmt!r}"
            )
        at = f"{where}.weights"
        expect(weights, "num_bits", (4,), where=at)
        expect(weights, "strategy", ("group",), where=at)
        expect(weights, "group_size", (GROUP,), where=at)
        expect(weights, "symmetric", (True,), where=at)
        expect(weights, "scale_dtype", (None, "torch.uint8"), where=at)
        if acts is not None:
            raise CheckpointError(
                f"quantization_config.{where}.input_activations: expected null for mxfp4 "
                f"weights (W4A16), got {acts!r}"
            )
        return {"kind": self.kind}

    # ---------------------------------------------------------------- tensor contract

    def tensor_names(self, scheme: SchemeView) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale")

    def marks_quantized(self, local: str, tensor: torch.Tensor) -> bool:
        return local in _LOCAL_NAMES

    def check(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, name: Callable[[str], str]
    ) -> tuple[int, int]:
        n, k = self._packed_shape(tensors, name)
        nans = int((tensors["weight_scale"] == E8M0_NAN).sum())
        if nans:
            raise CheckpointError(
                f"tensor {name('weight_scale')}: expected E8M0 exponents 0-254, got {nans} "
                f"of 255 (NaN)"
            )
        return n, k

    def empty(
        self, n: int, k: int, scheme: SchemeView, *, dtype: torch.dtype, device: Any
    ) -> dict[str, torch.Tensor | None]:
        return self._empty(n, k, device)

    # ---------------------------------------------------------------- the math

    def round_to_nearest(self, weight: torch.Tensor, scheme: SchemeView) -> Codes:
        codes, biased = mxfp4_quantize(weight)
        return Codes(codes, e8m0_values(biased), None)

    def pack(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        if q.zero is not None or q.global_scale is not None:
            raise SchemeError("codes: expected no zero point and no global scale for mxfp4")
        mantissa, e = torch.frexp(q.scale.float())
        if not bool(((mantissa == 0.5) & (e >= -126) & (e <= 128)).all()):
            raise SchemeError("scale: expected powers of two 2^-127 .. 2^127 for mxfp4, got others")
        return {
            "weight_packed": pack_fp4(q.codes),
            "weight_scale": (e - 1 + E8M0_BIAS).to(torch.uint8).contiguous(),
        }

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, *, dtype: torch.dtype
    ) -> torch.Tensor:
        codes = unpack_fp4(tensors["weight_packed"])
        return mxfp4_dequantize(codes, tensors["weight_scale"]).to(dtype)


MXFP4 = Mxfp4Format()
