"""Round-to-nearest INT4: the baseline every AWQ number is compared with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.int4 import INT4
from quantkit.format.packing import int4_dequantize, int4_qparams, int4_quantize
from quantkit.format.scheme import QuantScheme
from quantkit.format.weight_format import Codes


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

    def tensors(self, *, scheme: QuantScheme, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The checkpoint tensors with the scales stored in `dtype` (codes re-derived for the
        stored scales: `Int4Format.store`)."""
        return INT4.store(Codes(self.codes, self.scale, self.zero), scheme, dtype=dtype)


def rtn_quantize_weight(
    w: torch.Tensor, *, scheme: QuantScheme, clip_ratio: float | torch.Tensor = 1.0
) -> Int4Weights:
    g = scheme.group_size_for(w.shape[1])
    scale, zero = int4_qparams(w, group_size=g, symmetric=scheme.symmetric, clip_ratio=clip_ratio)
    return Int4Weights(int4_quantize(w, scale, zero, group_size=g), scale, zero)
