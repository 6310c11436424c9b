"""Pure-torch reference of the W4A16 linear: dequantize with quantkit's packing, matmul in fp32.

This is the oracle every kernel is tested against, and the fallback backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantkit.format.packing import dequantize_packed_int4

if TYPE_CHECKING:
    from quantkit.fused_kernels.packed_weights import PackedInt4


def w4a16_linear_reference(
    x: torch.Tensor,
    weights: PackedInt4,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias), computed in fp32, returned in x.dtype."""
    w = dequantize_packed_int4(
        *weights.tensors, in_features=weights.in_features, group_size=weights.group_size
    )
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
