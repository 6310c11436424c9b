"""Backend dispatch for the quantized linear ops used by `QuantLinear`.

Backends: `reference` (pure torch, everywhere). `QUANTKIT_BACKEND` overrides the choice.
"""

from __future__ import annotations

import os

import torch

from quantkit.fused_kernels.w4a16_reference import w4a16_linear_reference
from quantkit.scheme import QuantScheme

BACKENDS = ("reference",)


def choose_backend(device: torch.device, *, override: str | None = None) -> str:
    """The backend to use on `device`; `override` or $QUANTKIT_BACKEND wins."""
    wanted = override or os.environ.get("QUANTKIT_BACKEND") or "reference"
    return wanted


def int4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    scheme: QuantScheme,
    in_features: int,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T for compressed-tensors pack-quantized INT4 weights."""
    group_size = in_features if scheme.group_size == -1 else int(scheme.group_size)
    return w4a16_linear_reference(
        x, weight_packed, weight_scale, weight_zero_point,
        in_features=in_features, group_size=group_size, bias=bias,
    )
