"""Pure-torch reference of the INT8 W8A8 linear: the exact emulation of an int8 x int8 matmul.

The oracle of the C kernel (`cpu.int8`) and the `reference-int8` entry of `kernel_registry`.
Weights are compressed-tensors `int-quantized`: int8 [N, K] with a per-output-channel scale
[N, 1] (`quantkit.format.packing`); the activations are quantized per token at run time.

    xq, sx = int8_absmax(x)            # per token: sx = absmax / 127, xq = round(x / sx)
    acc    = xq @ wq.T                  # integers, exact (int32 result)
    y      = float(acc) * sx * sw       # fp32, in this order (+ bias)

The integer products are summed in float64, which holds every partial sum exactly (each
product is at most 127 * 128 in magnitude, so a sum stays far below 2^53), then converted to
int32; any kernel that sums the same integers exactly and rescales in the same fp32 order
matches this bit for bit.
"""

from __future__ import annotations

import torch

from quantkit.format.packing import int8_absmax

# |acc| <= K * 127 * 128 must fit int32.
MAX_K = (2**31 - 1) // (127 * 128)


def int8_matmul_exact(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = xq [M, K] @ wq [N, K].T for int8 operands, exactly."""
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise ValueError(f"expected int8 operands, got {xq.dtype} and {wq.dtype}")
    if xq.shape[-1] > MAX_K:
        raise ValueError(f"K: expected at most {MAX_K} (an int32 sum), got {xq.shape[-1]}")
    return (xq.double() @ wq.double().T).to(torch.int32)


def int8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = (q(x) @ wq.T) * sx * sw (+ bias), in fp32, returned in x.dtype; q(x) is x
    rounded to int8 per token (see the module docstring)."""
    if weight.dtype != torch.int8:
        raise ValueError(f"weight: expected int8, got {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dim {k} (in_features), got {x.shape[-1]}")
    if weight_scale.numel() != n:
        raise ValueError(f"weight_scale: expected {n} values, got {weight_scale.numel()}")
    lead = x.shape[:-1]
    xq, sx = int8_absmax(x.reshape(-1, k))
    acc = int8_matmul_exact(xq, weight)
    y = acc.float() * sx * weight_scale.float().reshape(1, n)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, n)
