"""GPTQ's rounding for the FP4 formats (NVFP4, MXFP4): a `gptq.Rounder` on RTN's scales.

The scales are fixed before GPTQ starts, from the weight as given (for a group of Linears that
share an input, their stacked rows: so NVFP4's global scale is shared, as `round_and_store_group`
gives it): NVFP4's E4M3 group scales under the global scale, MXFP4's E8M0 exponents. A column is
then rounded onto the E2M1 grid of its group's scale, found from its original index (act-order
permutes the columns), saturating at 6 when the error updates push it past the group's range.
"""

from __future__ import annotations

import torch

from quantkit.format.fp4 import e2m1_codes, e2m1_values
from quantkit.format.mxfp4 import e8m0_values, mx_exponents
from quantkit.format.nvfp4 import nvfp4_effective_scale, nvfp4_global_scale, nvfp4_group_scales
from quantkit.format.scheme import QuantScheme
from quantkit.format.weight_format import Codes


class Fp4Rounder:
    """E2M1 codes on fixed group scales; `scale_dtype` is unused (FP4 scales have their own
    dtypes) and taken for the signature every rounder shares."""

    def __init__(self, w: torch.Tensor, scheme: QuantScheme, *, scale_dtype: torch.dtype) -> None:
        self.scheme = scheme
        self.group = scheme.group_size_for(w.shape[1])
        self.global_scale: torch.Tensor | None = None
        if scheme.kind == "nvfp4":
            self.global_scale = nvfp4_global_scale(w.float().abs().amax())
            self.scale = nvfp4_group_scales(w, self.global_scale)  # stored values, fp32
            self.effective = nvfp4_effective_scale(self.scale, self.global_scale)
        else:
            self.scale = e8m0_values(mx_exponents(w) + 127)
            self.effective = self.scale

    def _codes(
        self, columns: torch.Tensor, index: torch.Tensor, rows: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, their scales) of `columns` (rows `rows` of the weight) at column `index`."""
        s = self.effective[rows][:, index // self.group]
        return e2m1_codes(columns.float() / s), s

    def round(self, columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        codes, s = self._codes(columns, index)
        return e2m1_values(codes) * s

    def nearest(self, w: torch.Tensor) -> torch.Tensor:
        return self.round(w, torch.arange(w.shape[1], device=w.device))

    def codes(self, q: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        # q holds value * scale up to one fp32 rounding, far below the grid's spacing.
        return self._codes(q, torch.arange(q.shape[1], device=q.device), rows)[0]

    def stored(self, q: torch.Tensor) -> torch.Tensor:
        return self.round(q, torch.arange(q.shape[1], device=q.device))

    def tensors(
        self, q: torch.Tensor, rows: slice, *, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        codes = Codes(self.codes(q[rows], rows), self.scale[rows], None, self.global_scale)
        return self.scheme.format.pack(codes, self.scheme, dtype=dtype)
