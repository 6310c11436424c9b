"""Round-to-nearest INT4: the baseline every AWQ number is compared with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.packing import int4_dequantize, int4_qparams, int4_quantize
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import int4_tensors


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
        """The checkpoint tensors with the scales stored in `dtype`. The codes were chosen for
        fp32 scales; they are re-derived for the scale as stored, so the checkpoint's weights
        are the best this storage dtype allows."""
        scale = self.scale.to(dtype).float()
        g = scheme.group_size_for(self.codes.shape[1])
        w = int4_dequantize(self.codes, self.scale, self.zero, group_size=g)
        codes = int4_quantize(w, scale, self.zero, group_size=g)
        return int4_tensors(codes, scale, self.zero, dtype=dtype)


def rtn_quantize_weight(
    w: torch.Tensor, *, scheme: QuantScheme, clip_ratio: float | torch.Tensor = 1.0
) -> Int4Weights:
    g = scheme.group_size_for(w.shape[1])
    scale, zero = int4_qparams(w, group_size=g, symmetric=scheme.symmetric, clip_ratio=clip_ratio)
    return Int4Weights(int4_quantize(w, scale, zero, group_size=g), scale, zero)
