"""Pure-torch reference of the FP8 linear (W8A16 and dynamic per-token W8A8).

The oracle of the FP8 kernels (`cpu.fp8`, `triton.fp8`) and the `reference-fp8` entry of
`kernel_registry`.
Weights are compressed-tensors `float-quantized`: float8_e4m3fn [N, K] with a per-output-channel
scale [N, 1] (see `quantkit.format.packing`).
"""

from __future__ import annotations

import torch

from quantkit.format.packing import dequantize_fp8, quantize_fp8_per_token


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act_dynamic: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (w8 * s).T (+ bias), in fp32, returned in x.dtype.

    act_dynamic (W8A8): x is first rounded to fp8 with one scale per token (row absmax / 448),
    as the fp8 tensor-core kernel does, so this reference carries the activation rounding
    error too: y = (x8 @ w8.T) * sx * sw.T.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight: expected float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dim {k} (in_features), got {x.shape[-1]}")
    if weight_scale.numel() != n:
        raise ValueError(f"weight_scale: expected {n} values, got {weight_scale.numel()}")
    if act_dynamic:
        x8, x_scale = quantize_fp8_per_token(x)
        # Each product of two fp8 values is exact in fp32; only the accumulation rounds, as in an
        # fp8 tensor-core dot with an fp32 accumulator.
        y = (x8.float() @ weight.float().T) * x_scale * weight_scale.float().reshape(1, n)
    else:
        y = x.float() @ dequantize_fp8(weight, weight_scale.reshape(n, 1)).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
