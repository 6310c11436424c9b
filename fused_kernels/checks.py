"""Input checks shared by every W4A16 launcher: dtype, shape, device, with expected-vs-got text.

Shape and dtype mistakes are `ValueError`s (the caller passed wrong tensors); a dtype or device a
backend cannot run on is `KernelUnavailableError` (the tensors are fine, the backend is not).
"""

from __future__ import annotations

from typing import Protocol

import torch

from quantkit.errors import KernelUnavailableError

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Int4Weights(Protocol):
    """What the INT4 checks read of a layer's packed weights (`packed_weights.PackedInt4`)."""

    weight_packed: torch.Tensor
    in_features: int
    group_size: int

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


def check_prepared_input(x: torch.Tensor, *, in_features: int, backend: str) -> None:
    """The per-call check of a prepared layer (INT4 or FP8): x [..., in_features], a float
    activation dtype the kernels take."""
    if x.shape[-1] != in_features:
        raise ValueError(
            f"x: expected shape [..., {in_features}] (in_features), got {tuple(x.shape)}"
        )
    if x.dtype not in ACT_DTYPES:
        raise KernelUnavailableError(
            f"{backend} backend: expected float32/bfloat16/float16 activations, got {x.dtype}"
        )


def resolve_group_size(group_size: int, in_features: int) -> int:
    """-1 (per channel) -> in_features; otherwise group_size, which must divide in_features."""
    if group_size == -1:
        return in_features
    if group_size <= 0 or in_features % group_size:
        raise ValueError(
            f"group_size: expected -1 or a positive divisor of in_features {in_features}, "
            f"got {group_size}"
        )
    return group_size


def check_int4_operands(
    x: torch.Tensor,
    weights: Int4Weights,
    *,
    bias: torch.Tensor | None = None,
    backend: str,
) -> None:
    """Raise unless x, `weights` and `bias` form one valid compressed-tensors W4A16 linear."""
    check_int4_weights(weights, bias=bias)
    in_features, device = weights.in_features, weights.weight_packed.device
    if x.dtype not in ACT_DTYPES:
        raise KernelUnavailableError(
            f"{backend} backend: expected activations in float32, bfloat16 or float16, "
            f"got {x.dtype}"
        )
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(
            f"x: expected shape [..., {in_features}] (in_features), got {tuple(x.shape)}"
        )
    if x.device != device:
        raise ValueError(f"x: expected the weights' device {device}, got {x.device}")


def check_int4_weights(weights: Int4Weights, *, bias: torch.Tensor | None = None) -> None:
    """The weight half of `check_int4_operands` (`PackedInt4.check`, run once by
    `prepare_linear`)."""
    weight_packed, weight_scale, weight_zero_point = weights.tensors
    in_features, group_size = weights.in_features, weights.group_size
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise ValueError(
            "weight_packed: expected a 2-D int32 tensor [N, ceil(K/8)], "
            f"got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    n, words = weight_packed.shape
    if words != (in_features + 7) // 8:
        raise ValueError(
            f"weight_packed: expected {(in_features + 7) // 8} words per row for in_features "
            f"{in_features}, got {words}"
        )
    groups = in_features // group_size
    if weight_scale.shape != (n, groups) or weight_scale.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"weight_scale: expected a float [{n}, {groups}] tensor, got {weight_scale.dtype} "
            f"{tuple(weight_scale.shape)}"
        )
    if weight_zero_point is not None and (
        weight_zero_point.dtype != torch.int32 or weight_zero_point.shape != ((n + 7) // 8, groups)
    ):
        raise ValueError(
            f"weight_zero_point: expected int32 [{(n + 7) // 8}, {groups}], got "
            f"{weight_zero_point.dtype} {tuple(weight_zero_point.shape)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype not in SCALE_DTYPES):
        raise ValueError(
            f"bias: expected a float [{n}] tensor, got {bias.dtype} {tuple(bias.shape)}"
        )
    for name, t in (
        ("weight_scale", weight_scale),
        ("weight_zero_point", weight_zero_point),
        ("bias", bias),
    ):
        if t is not None and t.device != weight_packed.device:
            raise ValueError(
                f"{name}: expected weight_packed's device {weight_packed.device}, got {t.device}"
            )


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


def check_int8_weights(
    weight: torch.Tensor, weight_scale: torch.Tensor, *, bias: torch.Tensor | None = None
) -> tuple[int, int]:
    """Raise unless (weight, weight_scale, bias) form one compressed-tensors `int-quantized`
    (W8A8 INT8) linear: int8 [N, K], a float scale with N values ([N, 1] as stored, or [N]), a
    float bias [N]. Returns (N, K)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(
            f"weight: expected a 2-D int8 tensor [N, K], got {weight.dtype} {tuple(weight.shape)}"
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
