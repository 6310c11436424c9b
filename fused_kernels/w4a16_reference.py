"""Pure-torch reference of the W4A16 linear: dequantize with quantkit's packing, matmul in fp32.

This is the oracle every kernel is tested against, and the fallback backend.
"""

from __future__ import annotations

import torch

from quantkit.format.packing import dequantize_packed_int4


def w4a16_linear_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    in_features: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias), computed in fp32, returned in x.dtype."""
    w = dequantize_packed_int4(
        weight_packed,
        weight_scale,
        weight_zero_point,
        in_features=in_features,
        group_size=group_size,
    )
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
