"""Input checks shared by every FP8 launcher: dtype, shape, device, with expected-vs-got text.

As for INT4 (`w4a16_checks`): shape and dtype mistakes are `ValueError`s (the caller passed wrong
tensors); a dtype or device a backend cannot run on is `KernelUnavailableError`.
"""

from __future__ import annotations

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.w4a16_checks import ACT_DTYPES, SCALE_DTYPES


def check_fp8_weights(
    weight: torch.Tensor, weight_scale: torch.Tensor, *, bias: torch.Tensor | None = None
) -> tuple[int, int]:
    """Raise unless (weight, weight_scale, bias) form one compressed-tensors `float-quantized`
    linear: float8_e4m3fn [N, K], a float scale with N values ([N, 1] as stored, or [N]), a
    float bias [N]. Returns (N, K)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            "weight: expected a 2-D float8_e4m3fn tensor [N, K], "
            f"got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if weight_scale.dtype not in SCALE_DTYPES or tuple(weight_scale.shape) not in ((n, 1), (n,)):
        raise ValueError(
            f"weight_scale: expected a float [{n}, 1] tensor (one scale per output row), "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype not in SCALE_DTYPES):
        raise ValueError(
            f"bias: expected a float [{n}] tensor, got {bias.dtype} {tuple(bias.shape)}"
        )
    for name, t in (("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != weight.device:
            raise ValueError(f"{name}: expected weight's device {weight.device}, got {t.device}")
    return n, k


def check_fp8_activations(x: torch.Tensor, weight: torch.Tensor, *, backend: str) -> None:
    """Raise unless x [..., K] can multiply `weight` [N, K] on `backend`."""
    k = weight.shape[1]
    if x.dtype not in ACT_DTYPES:
        raise KernelUnavailableError(
            f"{backend} backend: expected activations in float32, bfloat16 or float16, "
            f"got {x.dtype}"
        )
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., {k}] (in_features), got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x: expected the weights' device {weight.device}, got {x.device}")
