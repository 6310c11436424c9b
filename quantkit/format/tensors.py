"""The tensor contract of one quantized Linear, and its one validator.

A quantized Linear W [N = out, K = in] is stored exactly as compressed-tensors stores it (layout
in `quantkit.format.packing`), under the same local names:

- INT4: `weight_packed` int32 [N, ceil(K/8)], `weight_scale` [N, K/G] (model dtype),
  `weight_zero_point` int32 [ceil(N/8), K/G] (asymmetric only), `weight_shape` [2] = [N, K].
- FP8: `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1].
- optional `bias` [N].

`check_module_tensors` is the one validator of that contract; the checkpoint writer and loader
and `QuantLinear.from_tensors` all call it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.packing import pack_int4, pack_zero_points
from quantkit.format.scheme import QuantScheme

_SHAPE_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- tensor contract


def int4_tensors(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    *,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One INT4 Linear's tensors (local names) from codes int8 [N, K] in [-8, 7].

    `scale` [N, G] is stored in `dtype` (the model dtype); `zero` int [N, G], or None when
    symmetric.
    """
    if codes.dim() != 2:
        raise CheckpointError(f"codes: expected a 2-D [N, K] tensor, got {tuple(codes.shape)}")
    n, k = codes.shape
    if scale.dim() != 2 or scale.shape[0] != n:
        raise CheckpointError(f"scale: expected [{n}, groups], got {tuple(scale.shape)}")
    if zero is not None and zero.shape != scale.shape:
        raise CheckpointError(
            f"zero: expected the scale's shape {tuple(scale.shape)}, got {tuple(zero.shape)}"
        )
    out = {
        "weight_packed": pack_int4(codes).contiguous(),
        "weight_scale": scale.to(dtype).contiguous(),
        # int64: what compressed-tensors' own compressor writes (torch.tensor(weight.shape)).
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if zero is not None:
        out["weight_zero_point"] = pack_zero_points(zero).contiguous()
    return out


def fp8_tensors(
    w8: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One FP8 Linear's tensors: `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1] in dtype."""
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2:
        raise CheckpointError(
            f"w8: expected a 2-D float8_e4m3fn tensor, got {w8.dtype} {tuple(w8.shape)}"
        )
    n = w8.shape[0]
    if scale.numel() != n:
        raise CheckpointError(f"scale: expected {n} values (one per row), got {scale.numel()}")
    # [N, 1], not [N]: compressed-tensors' channel strategy keeps the trailing dim.
    return {"weight": w8.contiguous(), "weight_scale": scale.reshape(n, 1).to(dtype).contiguous()}


def check_module_tensors(
    tensors: Mapping[str, torch.Tensor], *, scheme: QuantScheme, prefix: str = ""
) -> tuple[int, int]:
    """Validate one module's tensors (local names) against `scheme`; return (N, K).

    Every problem is a CheckpointError naming the tensor ("<prefix>.<local name>") with the
    expected and the actual shape or dtype.
    """
    if not scheme.is_resolved:
        raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
    name = (lambda local: f"{prefix}.{local}") if prefix else (lambda local: local)
    if scheme.kind == "int4":
        required = ["weight_packed", "weight_scale", "weight_shape"]
        if not scheme.symmetric:
            required.append("weight_zero_point")
    else:
        required = ["weight", "weight_scale"]
    for local in required:
        if local not in tensors:
            raise CheckpointError(f"missing tensor {name(local)} ({scheme.describe()})")
    unexpected = sorted(set(tensors) - set(required) - {"bias"})
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {name(unexpected[0])}: a {scheme.describe()} module holds only "
            f"{', '.join(required)} (+ bias)"
        )

    if scheme.kind == "int4":
        shape_t = tensors["weight_shape"]
        _check(name("weight_shape"), shape_t, (2,), _SHAPE_DTYPES)
        n, k = (int(v) for v in shape_t.tolist())
        if n <= 0 or k <= 0:
            raise CheckpointError(
                f"tensor {name('weight_shape')}: expected [N, K] > 0, got {[n, k]}"
            )
        group = scheme.group_size_for(k)
        if k % group:
            raise CheckpointError(
                f"tensor {name('weight_shape')}: expected K divisible by group size {group}, "
                f"got K={k}"
            )
        groups = k // group
        _check(name("weight_packed"), tensors["weight_packed"], (n, (k + 7) // 8), (torch.int32,))
        _check(name("weight_scale"), tensors["weight_scale"], (n, groups), SCALE_DTYPES)
        if not scheme.symmetric:
            zp = tensors["weight_zero_point"]
            _check(name("weight_zero_point"), zp, ((n + 7) // 8, groups), (torch.int32,))
    else:
        w = tensors["weight"]
        if w.dim() != 2:
            raise CheckpointError(
                f"tensor {name('weight')}: expected 2-D [N, K], got {tuple(w.shape)}"
            )
        n, k = w.shape
        _check(name("weight"), w, (n, k), (torch.float8_e4m3fn,))
        _check(name("weight_scale"), tensors["weight_scale"], (n, 1), SCALE_DTYPES)
    if "bias" in tensors:
        _check(name("bias"), tensors["bias"], (n,), SCALE_DTYPES)
    return n, k


def _check(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise CheckpointError(
            f"tensor {name}: expected dtype {wanted}, got {str(t.dtype).removeprefix('torch.')}"
        )
