"""Pure-torch reference of the W4A16 linear: dequantize with quantkit's packing, matmul in fp32.

This is the oracle every kernel is tested against, and the fallback backend.
"""

from __future__ import annotations

import torch

from quantkit.packing import int4_dequantize, unpack_int4, unpack_zero_points


def dequantize_packed_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    in_features: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """compressed-tensors pack-quantized tensors -> dense W [N, K] in `dtype`."""
    n = weight_packed.shape[0]
    codes = unpack_int4(weight_packed, in_features)
    zero = None if weight_zero_point is None else unpack_zero_points(weight_zero_point, n)
    return int4_dequantize(codes, weight_scale, zero, group_size=group_size, dtype=dtype)


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
