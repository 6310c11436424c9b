"""What the per-output-channel 8-bit formats (fp8, int8) share: `weight` [N, K] holding the codes in
the format's own dtype and `weight_scale` [N, 1], one scale a row; the contract and the empty
buffers of such a Linear, once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from quantkit.errors import CheckpointError
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.weight_format import SchemeView, WeightFormat, check_tensor


class PerChannelFormat(WeightFormat):
    """`weight` [N, K] of `code_dtype` and `weight_scale` [N, 1]."""

    code_dtype: torch.dtype

    def tensor_names(self, scheme: SchemeView) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def marks_quantized(self, local: str, tensor: torch.Tensor) -> bool:
        return local == "weight_scale" or (local == "weight" and tensor.dtype == self.code_dtype)

    def check(
        self, tensors: Mapping[str, torch.Tensor], scheme: SchemeView, name: Callable[[str], str]
    ) -> tuple[int, int]:
        w = tensors["weight"]
        if w.dim() != 2:
            raise CheckpointError(
                f"tensor {name('weight')}: expected 2-D [N, K], got {tuple(w.shape)}"
            )
        n, k = w.shape
        check_tensor(name("weight"), w, (n, k), (self.code_dtype,))
        check_tensor(name("weight_scale"), tensors["weight_scale"], (n, 1), SCALE_DTYPES)
        return n, k

    def shape(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        n, k = tensors["weight"].shape
        return n, k

    def empty(
        self, n: int, k: int, scheme: SchemeView, *, dtype: torch.dtype, device: Any
    ) -> dict[str, torch.Tensor | None]:
        return {
            "weight": torch.empty(n, k, dtype=self.code_dtype, device=device),
            "weight_scale": torch.empty(n, 1, dtype=dtype, device=device),
        }
