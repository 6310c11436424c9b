"""`QuantLinear` and the tensor contract of one quantized Linear.

A quantized Linear W [N = out, K = in] is stored exactly as compressed-tensors stores it (layout
in `quantkit.packing`), under the same local names, so a checkpoint's tensors become a module's
buffers and `state_dict()` writes them back unchanged:

- INT4: `weight_packed` int32 [N, ceil(K/8)], `weight_scale` [N, K/G] (model dtype),
  `weight_zero_point` int32 [ceil(N/8), K/G] (asymmetric only), `weight_shape` [2] = [N, K].
- FP8: `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1].
- optional `bias` [N].

`check_module_tensors` is the one validator of that contract; the checkpoint writer and loader
and `QuantLinear.from_tensors` all call it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from quantkit.errors import CheckpointError, SchemeError
from quantkit.fused_kernels.dispatch import PreparedInt4, prepare_int4
from quantkit.fused_kernels.fp8_dispatch import PreparedFp8, prepare_fp8
from quantkit.packing import (
    int4_qparams,
    int4_quantize,
    pack_int4,
    pack_zero_points,
    quantize_fp8,
)
from quantkit.scheme import QuantScheme

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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
    if scheme.is_int:
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

    if scheme.is_int:
        shape_t = tensors["weight_shape"]
        _check(name("weight_shape"), shape_t, (2,), _SHAPE_DTYPES)
        n, k = (int(v) for v in shape_t.tolist())
        if n <= 0 or k <= 0:
            raise CheckpointError(
                f"tensor {name('weight_shape')}: expected [N, K] > 0, got {[n, k]}"
            )
        group = k if scheme.group_size == -1 else int(scheme.group_size)
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


# --------------------------------------------------------------------------- the module


class QuantLinear(nn.Module):
    """A Linear whose weight is stored compressed (INT4 or FP8) and dequantized inside the matmul.

    The compressed tensors are buffers named as in the checkpoint. Build one with `from_tensors`
    (from a checkpoint) or `from_float` (quantize a dense weight, RTN unless codes are given);
    the constructor allocates empty buffers of the right shapes for `load_state_dict`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        scheme: QuantScheme,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not scheme.is_resolved:
            raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        n, k = out_features, in_features
        if scheme.is_int:
            groups = scheme.groups(k)
            self.register_buffer(
                "weight_packed", torch.empty(n, (k + 7) // 8, dtype=torch.int32, device=device)
            )
            self.register_buffer("weight_scale", torch.empty(n, groups, dtype=dtype, device=device))
            zp = None
            if not scheme.symmetric:
                zp = torch.empty((n + 7) // 8, groups, dtype=torch.int32, device=device)
            self.register_buffer("weight_zero_point", zp)
            self.register_buffer(
                "weight_shape", torch.tensor([n, k], dtype=torch.int64, device=device)
            )
        else:
            self.register_buffer(
                "weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
            )
            self.register_buffer("weight_scale", torch.empty(n, 1, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        scheme: QuantScheme,
        bias: torch.Tensor | None = None,
    ) -> QuantLinear:
        """A QuantLinear holding `tensors` (local checkpoint names) as they are, once validated."""
        tensors = dict(tensors)
        if bias is not None:
            tensors["bias"] = bias
        n, k = check_module_tensors(tensors, scheme=scheme)
        scale = tensors["weight_scale"]
        # Meta buffers first, then the real tensors: no throwaway allocation of the weight.
        module = cls(k, n, scheme=scheme, bias="bias" in tensors, dtype=scale.dtype, device="meta")
        for local, t in tensors.items():
            setattr(module, local, t)
        return module

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear | torch.Tensor,
        *,
        scheme: QuantScheme,
        codes: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        zero: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> QuantLinear:
        """Quantize a dense Linear (or weight [N, K]) into a QuantLinear.

        With `codes`/`scale`/`zero` (int8 codes for INT4, float8 weights for FP8) from a
        quantizer such as AWQ, those are packed as given; without them the weight is
        round-to-nearest quantized. Scales are stored in `dtype` (default the weight's dtype).
        """
        if isinstance(linear, nn.Linear):
            weight, bias = linear.weight.detach(), linear.bias
        else:
            weight, bias = linear.detach(), None
        if weight.dim() != 2:
            raise SchemeError(f"weight: expected 2-D [N, K], got {tuple(weight.shape)}")
        if not scheme.is_resolved:
            raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
        dtype = dtype or (weight.dtype if weight.dtype in SCALE_DTYPES else torch.float32)
        if (codes is None) != (scale is None):
            raise SchemeError("codes and scale: expected both or neither, got only one")
        if scheme.is_int:
            group = scheme.group_size
            if codes is None:
                scale, zero = int4_qparams(weight, group_size=group, symmetric=scheme.symmetric)
                codes = int4_quantize(weight, scale, zero, group_size=group)
            if (zero is None) != scheme.symmetric:
                raise SchemeError(
                    f"zero: expected {'no zero point' if scheme.symmetric else 'zero points'} "
                    f"for {scheme.describe()}, got {'none' if zero is None else 'zero points'}"
                )
            tensors = int4_tensors(codes, scale, zero, dtype=dtype)
        else:
            if codes is None:
                codes, scale = quantize_fp8(weight)
            tensors = fp8_tensors(codes, scale, dtype=dtype)
        if bias is not None:
            tensors["bias"] = bias.detach().to(dtype)
        return cls.from_tensors(tensors, scheme=scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.is_int:
            return self._prepared_int4()(x)
        return self._prepared_fp8()(x)

    def _prepared_int4(self) -> PreparedInt4:
        """The kernel bound to this layer's tensors, made on first use and again whenever a
        tensor is replaced (`.to()`, `load_state_dict(assign=True)`) or QUANTKIT_BACKEND changes.

        Checking the operands and choosing the backend on every call cost ~15 us a linear, ~3 ms
        of a SmolLM2-135M decode step (210 linears)."""
        key = (
            self.weight_packed,
            self.weight_scale,
            self.weight_zero_point,
            self.bias,
            os.environ.get("QUANTKIT_BACKEND"),
        )
        cached = self.__dict__.get("_int4_cache")
        if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        prepared = prepare_int4(
            self.weight_packed,
            self.weight_scale,
            self.weight_zero_point,
            scheme=self.scheme,
            in_features=self.in_features,
            bias=self.bias,
        )
        # In __dict__, not as a submodule or buffer: state_dict() and .to() never see it.
        self.__dict__["_int4_cache"] = (key, prepared)
        return prepared

    def _prepared_fp8(self) -> PreparedFp8:
        """The FP8 kernel bound to this layer's tensors, cached like `_prepared_int4` (the
        cpu backend also scans the weight for NaN codes once, here, not per call)."""
        key = (self.weight, self.weight_scale, self.bias, os.environ.get("QUANTKIT_BACKEND"))
        cached = self.__dict__.get("_fp8_cache")
        if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        prepared = prepare_fp8(self.weight, self.weight_scale, scheme=self.scheme, bias=self.bias)
        self.__dict__["_fp8_cache"] = (key, prepared)
        return prepared

    def weight_bytes(self) -> int:
        """Bytes a forward pass reads from this layer's stored tensors: packed ints or fp8
        weight, scales, zero points and bias (weight_shape is metadata, never read)."""
        return sum(
            t.numel() * t.element_size()
            for name, t in self.named_buffers(recurse=False)
            if name != "weight_shape"
        )

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # nn.Module.half()/.to(dtype) convert every floating-point tensor, and float8 counts as
        # one: model.half() would silently turn the fp8 weight into fp16 (2x the bytes, and no
        # longer the checkpoint's tensor). Hide it as uint8 while `fn` runs; devices still apply.
        w = self._buffers.get("weight")
        if w is None or w.dtype != torch.float8_e4m3fn:
            return super()._apply(fn, recurse)
        self._buffers["weight"] = w.view(torch.uint8)
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers["weight"] = self._buffers["weight"].view(torch.float8_e4m3fn)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme.describe()}"
        )
