"""INT4 with group scales and zero points: compressed-tensors `pack-quantized` (W4A16).

One quantized Linear W [N, K] stores (bit layout in `quantkit.format.packing`):
`weight_packed` int32 [N, ceil(K/8)], `weight_scale` [N, K/G] in the model dtype,
`weight_zero_point` int32 [ceil(N/8), K/G] (asymmetric only), `weight_shape` [2] = [N, K].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.packing import (
    dequantize_packed_int4,
    int4_dequantize,
    int4_qparams,
    int4_quantize,
    pack_int4,
    pack_zero_points,
)
from quantkit.format.weight_format import (
    Codes,
    SchemeView,
    Tensors,
    WeightFormat,
    check_tensor,
    expect,
)

GROUP_SIZES: tuple[int, ...] = (32, 64, 128, -1)
_SHAPE_DTYPES = (torch.int32, torch.int64)
# Every tensor name an INT4 module carries and no dense module does.
_LOCAL_NAMES = frozenset({"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"})


def int4_tensors(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    *,
    dtype: torch.dtype,
) -> Tensors:
    """One INT4 Linear's tensors (local names) from codes int8 [N, K] in [-8, 7].

    `scale` [N, G] is stored in `dtype` (the model dtype); `zero` int [N, G], or None when
    symmetric.
    """
    if codes.dim() != 2:
        raise CheckpointError(f"codes: expected a 2-D [N, K] tensor, got {tuple(codes.shape)}")
    n, k = codes.shape
    if scale.dim() != 2 or scale.shape[0] != n:
        raise CheckpointError(f"scale: expected [{n}, groups], got {tuple(scale.shape)}")
    if zero is not None and zero.shape != scale.shape:
        raise CheckpointError(
            f"zero: expected the scale's shape {tuple(scale.shape)}, got {tuple(zero.shape)}"
        )
    out = {
        "weight_packed": pack_int4(codes).contiguous(),
        "weight_scale": scale.to(dtype).contiguous(),
        # int64: what compressed-tensors' own compressor writes (torch.tensor(weight.shape)).
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if zero is not None:
        out["weight_zero_point"] = pack_zero_points(zero).contiguous()
    return out


class Int4Format(WeightFormat):
    kind = "int4"
    bits = 4
    grouped = True
    dynamic_activations = False
    c_step = True
    ct_type = "int"
    ct_formats = ("pack-quantized",)

    def normalized(self, scheme: SchemeView) -> dict[str, Any]:
        if scheme.group_size != "auto" and scheme.group_size not in GROUP_SIZES:
            raise SchemeError(
                "group_size: expected auto, 32, 64, 128 or -1 (per channel), "
                f"got {scheme.group_size!r}"
            )
        if scheme.activations != "none":
            raise SchemeError(
                f"activations: int4 is weight-only (W4A16; fp8 and int8 quantize activations), "
                f"got {scheme.activations!r}"
            )
        return {}

    def describe(self, scheme: SchemeView, algorithm: str | None) -> str:
        group = "per-channel" if scheme.group_size == -1 else f"g{scheme.group_size}"
        kind = "symmetric" if scheme.symmetric else "asymmetric"
        return f"{f'{algorithm} ' if algorithm else ''}int4 {group} {kind}"

    # ---------------------------------------------------------------- compressed-tensors

    def config_entries(self, scheme: SchemeView) -> tuple[dict[str, Any], dict[str, Any] | None]:
        per_channel = scheme.group_size == -1
        weights = {
            "num_bits": 4,
            "type": "int",
            "strategy": "channel" if per_channel else "group",
            # compressed-tensors writes null, not -1, for the channel strategy.
            "group_size": None if per_channel else scheme.group_size,
            "symmetric": scheme.symmetric,
            "dynamic": False,
        }
        return weights, None

    def scheme_fields(
        self, weights: Mapping[str, Any], *, fmt: Any, acts: Any, where: str
    ) -> dict[str, Any]:
        if fmt not in self.ct_formats:
            raise CheckpointError(
                f"quantization_config.{where}.format: expected {self.ct_formats[0]!r} for int "
                f"weights, got {fmt!r}"
            )
        at = f"{where}.weights"
        expect(weights, "num_bits", (4,), where=at)
        expect(weights, "symmetric", (True, False), where=at)
        strategy = expect(weights, "strategy", ("group", "channel"), where=at)
        if strategy == "channel":
            expect(weights, "group_size", (None, -1), where=at)
            group_size = -1
        else:
            expect(weights, "group_size", tuple(g for g in GROUP_SIZES if g > 0), where=at)
            group_size = int(weights["group_size"])
        if acts is not None:
            raise CheckpointError(
                f"quantization_config.{where}.input_activations: expected null for int4 weights "
                f"(W4A16), got {acts!r}"
            )
        return {"kind": "int4", "group_size": group_size, "symmetric": bool(weights["symmetric"])}

    # ---------------------------------------------------------------- tensor contract

    def tensor_names(self, scheme: SchemeView) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        return names if scheme.symmetric else (*names, "weight_zero_point")

    def marks_quantized(self, local: str, tensor: torch.Tensor) -> bool:
        return local in _LOCAL_NAMES

    def check(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, name: Callable[[str], str]
    ) -> tuple[int, int]:
        shape_t = tensors["weight_shape"]
        check_tensor(name("weight_shape"), shape_t, (2,), _SHAPE_DTYPES)
        n, k = (int(v) for v in shape_t.tolist())
        if n <= 0 or k <= 0:
            raise CheckpointError(
                f"tensor {name('weight_shape')}: expected [N, K] > 0, got {[n, k]}"
            )
        group = scheme.group_size_for(k)
        if k % group:
            raise CheckpointError(
                f"tensor {name('weight_shape')}: expected K divisible by group size {group}, "
                f"got K={k}"
            )
        groups = k // group
        packed = tensors["weight_packed"]
        check_tensor(name("weight_packed"), packed, (n, (k + 7) // 8), (torch.int32,))
        check_tensor(name("weight_scale"), tensors["weight_scale"], (n, groups), SCALE_DTYPES)
        if not scheme.symmetric:
            zp = tensors["weight_zero_point"]
            check_tensor(name("weight_zero_point"), zp, ((n + 7) // 8, groups), (torch.int32,))
        return n, k

    def shape(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        n, k = (int(v) for v in tensors["weight_shape"].tolist())
        return n, k

    def empty(
        self, n: int, k: int, scheme: SchemeView, *, dtype: torch.dtype, device: Any
    ) -> dict[str, torch.Tensor | None]:
        groups = scheme.groups(k)
        zp = None
        if not scheme.symmetric:
            zp = torch.empty((n + 7) // 8, groups, dtype=torch.int32, device=device)
        return {
            "weight_packed": torch.empty(n, (k + 7) // 8, dtype=torch.int32, device=device),
            "weight_scale": torch.empty(n, groups, dtype=dtype, device=device),
            "weight_zero_point": zp,
            "weight_shape": torch.tensor([n, k], dtype=torch.int64, device=device),
        }

    # ---------------------------------------------------------------- the math

    def round_to_nearest(self, weight: torch.Tensor, scheme: SchemeView) -> Codes:
        g = scheme.group_size_for(weight.shape[1])
        scale, zero = int4_qparams(weight, group_size=g, symmetric=scheme.symmetric)
        return Codes(int4_quantize(weight, scale, zero, group_size=g), scale, zero)

    def pack(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Tensors:
        if (q.zero is None) != scheme.symmetric:
            raise SchemeError(
                f"zero: expected {'no zero point' if scheme.symmetric else 'zero points'} "
                f"for {scheme.describe()}, got {'none' if q.zero is None else 'zero points'}"
            )
        return int4_tensors(q.codes, q.scale, q.zero, dtype=dtype)

    def stored_codes(self, q: Codes, scheme: SchemeView, *, dtype: torch.dtype) -> Codes:
        """The codes were chosen for fp32 scales; they are re-derived for the scale as stored,
        so the checkpoint's weights are the best this storage dtype allows."""
        scale = q.scale.to(dtype).float()
        g = scheme.group_size_for(q.codes.shape[1])
        w = int4_dequantize(q.codes, q.scale, q.zero, group_size=g)
        return Codes(int4_quantize(w, scale, q.zero, group_size=g), scale, q.zero)

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, *, dtype: torch.dtype
    ) -> torch.Tensor:
        _, k = self.shape(tensors)
        return dequantize_packed_int4(
            tensors["weight_packed"],
            tensors["weight_scale"],
            tensors.get("weight_zero_point"),
            in_features=k,
            group_size=scheme.group_size_for(k),
            dtype=dtype,
        )


INT4 = Int4Format()
