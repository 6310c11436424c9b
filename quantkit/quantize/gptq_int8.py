"""GPTQ's rounding for INT8 (W8A8's per-channel int8 weights): a `gptq.Rounder` on RTN's scale.

The per-row scale is fixed before GPTQ starts, row absmax / 127 as `scale_dtype` stores it, so
the checkpoint's q * scale are exactly the values the error compensation saw; a column is then
rounded to nearest on it, clamped to +-127 when the error updates push it past the row's range
(`int8_codes`).
"""

from __future__ import annotations

import torch

from quantkit.format.int8 import int8_tensors
from quantkit.format.packing import int8_codes, int8_row_scale
from quantkit.format.scheme import QuantScheme


class Int8Rounder:
    """Symmetric int8 on RTN's per-row scale (row absmax / 127) as `scale_dtype` stores it."""

    def __init__(self, w: torch.Tensor, scheme: QuantScheme, *, scale_dtype: torch.dtype) -> None:
        self.scale = int8_row_scale(w).to(scale_dtype).float()

    def round(self, columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return int8_codes(columns, self.scale).float() * self.scale

    def nearest(self, w: torch.Tensor) -> torch.Tensor:
        return int8_codes(w, self.scale).float() * self.scale

    def codes(self, q: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        # q holds code * scale up to one fp32 rounding, far below a step: the exact codes.
        return int8_codes(q, self.scale[rows])

    def stored(self, q: torch.Tensor) -> torch.Tensor:
        return self.codes(q).float() * self.scale

    def tensors(
        self, q: torch.Tensor, rows: slice, *, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        return int8_tensors(self.codes(q[rows], rows), self.scale[rows], dtype=dtype)
