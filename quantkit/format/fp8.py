"""FP8 E4M3 with one scale per output channel: compressed-tensors `float-quantized`.

One quantized Linear W [N, K] stores `weight` float8_e4m3fn [N, K] and `weight_scale` [N, 1].
Activations stay 16/32-bit (W8A16) or are quantized per token at run time (W8A8 `dynamic`),
which stores nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.packing import dequantize_fp8, quantize_fp8
from quantkit.format.per_channel import PerChannelFormat
from quantkit.format.weight_format import (
    Codes,
    SchemeView,
    Tensors,
    expect,
)

# W8A8: the activation scale is computed per token at run time, so nothing is stored for it.
DYNAMIC_TOKEN_ACTIVATIONS: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "strategy": "token",
    "group_size": None,
    "symmetric": True,
    "dynamic": True,
}


def fp8_tensors(w8: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype) -> Tensors:
    """One FP8 Linear's tensors: `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1] in dtype."""
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2:
        raise CheckpointError(
            f"w8: expected a 2-D float8_e4m3fn tensor, got {w8.dtype} {tuple(w8.shape)}"
        )
    n = w8.shape[0]
    if scale.numel() != n:
        raise CheckpointError(f"scale: expected {n} values (one per row), got {scale.numel()}")
    # [N, 1], not [N]: compressed-tensors' channel strategy keeps the trailing dim.
    return {"weight": w8.contiguous(), "weight_scale": scale.reshape(n, 1).to(dtype).contiguous()}


class Fp8Format(PerChannelFormat):
    code_dtype = torch.float8_e4m3fn
    kind = "fp8"
    bits = 8
    grouped = False
    dynamic_activations = True
    c_step = False
    ct_type = "float"
    # compressed-tensors' own inference names FP8 without activation quantization
    # naive-quantized; the tensors are identical (same compressor class), so both read the same.
    ct_formats = ("float-quantized", "naive-quantized")

    def normalized(self, scheme: SchemeView) -> dict[str, Any]:
        if scheme.group_size not in (-1, "auto"):
            raise SchemeError(
                f"group_size: fp8 uses one scale per output channel (-1), got {scheme.group_size}"
            )
        # Per channel and symmetric by definition: fixed, so equal schemes compare equal.
        return {"group_size": -1, "symmetric": True}

    def describe(self, scheme: SchemeView, algorithm: str | None) -> str:
        act = "W8A8 dynamic per-token" if scheme.activations == "dynamic" else "W8A16"
        return f"fp8 e4m3 per-channel ({act}{f', {algorithm}' if algorithm else ''})"

    # ---------------------------------------------------------------- compressed-tensors

    def config_entries(self, scheme: SchemeView) -> tuple[dict[str, Any], dict[str, Any] | None]:
        weights = {
            "num_bits": 8,
            "type": "float",
            "strategy": "channel",
            "group_size": None,
            "symmetric": True,
            "dynamic": False,
        }
        acts = dict(DYNAMIC_TOKEN_ACTIVATIONS) if scheme.activations == "dynamic" else None
        return weights, acts

    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        if fmt not in self.ct_formats:
            raise CheckpointError(
                f"quantization_config.{where}.format: expected {self.ct_formats[0]!r} for float "
                f"weights, got {fmt!r}"
            )
        at = f"{where}.weights"
        expect(weights, "num_bits", (8,), where=at)
        expect(weights, "strategy", ("channel",), where=at)
        expect(weights, "symmetric", (True,), where=at)
        if acts is None:
            return {"kind": "fp8", "activations": "none"}
        if not isinstance(acts, Mapping):
            raise CheckpointError(
                f"quantization_config.{where}.input_activations: expected null or a dict, "
                f"got {acts!r}"
            )
        for key, want in DYNAMIC_TOKEN_ACTIVATIONS.items():
            if key != "group_size":
                expect(acts, key, (want,), where=f"{where}.input_activations")
        return {"kind": "fp8", "activations": "dynamic"}

    # ---------------------------------------------------------------- tensor contract

    # ---------------------------------------------------------------- the math

    def round_to_nearest(self, weight: torch.Tensor, scheme: SchemeView) -> Codes:
        # A per-output-channel absmax scale is all E4M3 needs.
        w8, scale = quantize_fp8(weight)
        return Codes(w8, scale, None)

    def pack(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        if q.zero is not None:
            raise SchemeError("zero: expected no zero point for fp8, got zero points")
        return fp8_tensors(q.codes, q.scale, dtype=dtype)

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, *, dtype: torch.dtype
    ) -> torch.Tensor:
        return dequantize_fp8(tensors["weight"], tensors["weight_scale"], dtype=dtype)


FP8 = Fp8Format()
