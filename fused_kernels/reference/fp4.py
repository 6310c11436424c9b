"""Pure-torch reference of the NVFP4 / MXFP4 linear (W4A16, and NVFP4 W4A4 emulated).

The `reference-nvfp4` and `reference-mxfp4` entries of `kernel_registry` and the oracle of any
FP4 kernel. The weights are dequantized with the format's own math (`quantkit.format.nvfp4`,
`quantkit.format.mxfp4`) and multiplied in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantkit.format.fp4 import unpack_fp4
from quantkit.format.mxfp4 import mxfp4_dequantize
from quantkit.format.nvfp4 import nvfp4_dequantize, nvfp4_fake_quantize

if TYPE_CHECKING:
    from quantkit.fused_kernels.packed_weights import PackedFp4


def dequantize_fp4_weights(weights: PackedFp4) -> torch.Tensor:
    """The dense fp32 weight [N, K]."""
    codes = unpack_fp4(weights.weight_packed)
    if weights.kind == "nvfp4":
        assert weights.weight_global_scale is not None
        return nvfp4_dequantize(codes, weights.weight_scale, weights.weight_global_scale)
    return mxfp4_dequantize(codes, weights.weight_scale)


def fp4_linear_reference(
    x: torch.Tensor,
    weights: PackedFp4,
    *,
    act_dynamic: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias), in fp32, returned in x.dtype.

    act_dynamic (NVFP4 W4A4): x is first rounded to NVFP4 per group of 16 along K on the stored
    `input_global_scale` and dequantized (`nvfp4_fake_quantize`), as compressed-tensors'
    forward does, so the result carries the activation rounding error too.
    """
    xf = x.float()
    if act_dynamic:
        if weights.input_global_scale is None:
            raise ValueError("input_global_scale: expected a tensor for W4A4, got none")
        xf = nvfp4_fake_quantize(xf, weights.input_global_scale)
    y = xf @ dequantize_fp4_weights(weights).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
