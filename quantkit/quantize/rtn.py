"""Round-to-nearest INT4: the baseline every AWQ number is compared with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.packing import int4_dequantize, int4_qparams, int4_quantize
from quantkit.format.scheme import QuantScheme


@dataclass
class Int4Weights:
    """One quantized Linear: codes int8 [N, K], scale fp32 [N, G], zero int32 [N, G] or None."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    def dequantize(self, *, group_size: int, dtype: torch.dtype) -> torch.Tensor:
        return int4_dequantize(
            self.codes, self.scale, self.zero, group_size=group_size, dtype=dtype
        )


def group_size_for(scheme: QuantScheme, in_features: int) -> int:
    """The concrete group size of a resolved scheme (-1 -> K)."""
    assert scheme.is_resolved, "resolve the scheme against the model first"
    return in_features if scheme.group_size == -1 else int(scheme.group_size)


def rtn_quantize_weight(
    w: torch.Tensor, *, scheme: QuantScheme, clip_ratio: float | torch.Tensor = 1.0
) -> Int4Weights:
    g = group_size_for(scheme, w.shape[1])
    scale, zero = int4_qparams(w, group_size=g, symmetric=scheme.symmetric, clip_ratio=clip_ratio)
    return Int4Weights(int4_quantize(w, scale, zero, group_size=g), scale, zero)
