"""INT8 W8A8: int8 weights with one scale per output channel, int8 activations quantized per
token at run time. compressed-tensors `int-quantized`, as llm-compressor writes its W8A8 INT8
scheme (the `W8A8` / `INT8` preset).

One quantized Linear W [N, K] stores `weight` int8 [N, K] and `weight_scale` [N, 1]
(W ~= q * s, s = row absmax / 127: `quantkit.format.packing`). The activations' scale is
computed per token at run time (x ~= q * absmax / 127), so nothing is stored for it.

W8A8 only: `activations` is always `dynamic`. Int8 weights with 16-bit activations (W8A16) are
another compressed-tensors format (`pack-quantized`, four codes an int32 word), not this one;
for 8-bit weights with float activations quantkit has fp8. `--bits 8` names fp8; this format is
named with `--format int8`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.packing import dequantize_int8, int8_codes, int8_row_scale
from quantkit.format.per_channel import PerChannelFormat
from quantkit.format.weight_format import (
    Codes,
    SchemeView,
    Tensors,
    expect,
)

# The config entries, exactly compressed-tensors' INT8_W8A8 preset (`quant_scheme.py`).
WEIGHTS: dict[str, Any] = {
    "num_bits": 8,
    "type": "int",
    "strategy": "channel",
    "group_size": None,
    "symmetric": True,
    "dynamic": False,
}
DYNAMIC_TOKEN_ACTIVATIONS: dict[str, Any] = {
    "num_bits": 8,
    "type": "int",
    "strategy": "token",
    "group_size": None,
    "symmetric": True,
    "dynamic": True,
}


def int8_tensors(codes: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype) -> Tensors:
    """One INT8 Linear's tensors: `weight` int8 [N, K], `weight_scale` [N, 1] in dtype."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise CheckpointError(
            f"codes: expected a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}"
        )
    n = codes.shape[0]
    if scale.numel() != n:
        raise CheckpointError(f"scale: expected {n} values (one per row), got {scale.numel()}")
    # [N, 1], not [N]: compressed-tensors' channel strategy keeps the trailing dim.
    return {
        "weight": codes.contiguous(),
        "weight_scale": scale.reshape(n, 1).to(dtype).contiguous(),
    }


class Int8Format(PerChannelFormat):
    code_dtype = torch.int8
    kind = "int8"
    bits = 8
    grouped = False
    dynamic_activations = True
    c_step = False
    ct_type = "int"
    ct_formats = ("int-quantized",)
    named_by_bits = False  # --bits 8 is fp8

    def normalized(self, scheme: SchemeView) -> dict[str, Any]:
        if scheme.group_size not in (-1, "auto"):
            raise SchemeError(
                f"group_size: int8 uses one scale per output channel (-1), got {scheme.group_size}"
            )
        # Per channel, symmetric and W8A8 by definition: fixed, so equal schemes compare equal.
        return {"group_size": -1, "symmetric": True, "activations": "dynamic"}

    def describe(self, scheme: SchemeView, algorithm: str | None) -> str:
        return f"int8 per-channel (W8A8 dynamic per-token{f', {algorithm}' if algorithm else ''})"

    # ---------------------------------------------------------------- compressed-tensors

    def config_entries(self, scheme: SchemeView) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return dict(WEIGHTS), dict(DYNAMIC_TOKEN_ACTIVATIONS)

    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        if fmt not in self.ct_formats:
            raise CheckpointError(
                f"quantization_config.{where}.format: expected {self.ct_formats[0]!r} for int8 "
                f"weights, got {fmt!r}"
            )
        at = f"{where}.weights"
        expect(weights, "num_bits", (8,), where=at)
        expect(weights, "strategy", ("channel",), where=at)
        expect(weights, "symmetric", (True,), where=at)
        if not isinstance(acts, Mapping):
            raise CheckpointError(
                f"quantization_config.{where}.input_activations: expected the dynamic per-token "
                f"int8 activations of W8A8, got {acts!r}"
            )
        for key, want in DYNAMIC_TOKEN_ACTIVATIONS.items():
            if key != "group_size":
                expect(acts, key, (want,), where=f"{where}.input_activations")
        return {"kind": "int8"}

    # ---------------------------------------------------------------- tensor contract

    # ---------------------------------------------------------------- the math

    def round_to_nearest(self, weight: torch.Tensor, scheme: SchemeView) -> Codes:
        scale = int8_row_scale(weight)
        return Codes(int8_codes(weight, scale), scale, None)

    def pack(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        if q.zero is not None:
            raise SchemeError("zero: expected no zero point for int8, got zero points")
        return int8_tensors(q.codes, q.scale, dtype=dtype)

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, *, dtype: torch.dtype
    ) -> torch.Tensor:
        return dequantize_int8(tensors["weight"], tensors["weight_scale"], dtype=dtype)


INT8 = Int8Format()
