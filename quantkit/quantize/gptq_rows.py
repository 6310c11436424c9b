"""GPTQ's rounding for the formats with one scale per output row, FP8 E4M3 (W8A16, W8A8) and
INT8 (W8A8): `gptq.Rounder`s on RTN's scale.

The per-row scale is fixed before GPTQ starts, row absmax / 448 (E4M3) or / 127 (int8) as
`scale_dtype` stores it, so the checkpoint's code * scale are exactly the values the error
compensation saw; a column is then rounded to nearest on it, clamped to the format's range when
the error updates push it past the row's (`fp8_codes`, `int8_codes`). q holds code * scale up to
one fp32 rounding, far below a step, so reading the codes back from q is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quantkit.format.fp8 import fp8_tensors
from quantkit.format.int8 import int8_tensors
from quantkit.format.packing import fp8_codes, fp8_row_scale, int8_codes, int8_row_scale
from quantkit.format.scheme import QuantScheme

Tensors = dict[str, torch.Tensor]


class RowRounder:
    """One scale per row as `scale_dtype` stores it; a format is its three functions."""

    row_scale: Callable[[torch.Tensor], torch.Tensor]  # W [N, K] -> scale [N, 1]
    to_codes: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (W, scale) -> codes
    to_tensors: Callable[..., Tensors]  # (codes, scale, dtype=) -> the checkpoint's tensors

    def __init__(self, w: torch.Tensor, scheme: QuantScheme, *, scale_dtype: torch.dtype) -> None:
        self.scale = type(self).row_scale(w).to(scale_dtype).float()

    def round(self, columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.nearest(columns)

    def nearest(self, w: torch.Tensor) -> torch.Tensor:
        return type(self).to_codes(w, self.scale).float() * self.scale

    def codes(self, q: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        return type(self).to_codes(q, self.scale[rows])

    def stored(self, q: torch.Tensor) -> torch.Tensor:
        return self.codes(q).float() * self.scale

    def tensors(self, q: torch.Tensor, rows: slice, *, dtype: torch.dtype) -> Tensors:
        return type(self).to_tensors(self.codes(q[rows], rows), self.scale[rows], dtype=dtype)


class Fp8Rounder(RowRounder):
    """E4M3 on the row absmax / 448."""

    row_scale = staticmethod(fp8_row_scale)
    to_codes = staticmethod(fp8_codes)
    to_tensors = staticmethod(fp8_tensors)


class Int8Rounder(RowRounder):
    """Symmetric int8 on the row absmax / 127."""

    row_scale = staticmethod(int8_row_scale)
    to_codes = staticmethod(int8_codes)
    to_tensors = staticmethod(int8_tensors)
