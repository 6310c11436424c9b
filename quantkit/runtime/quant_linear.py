"""`QuantLinear`: a Linear whose weight stays compressed (INT4 or FP8) and is dequantized inside
the matmul by the kernel that `quantkit.fused_kernels` chooses.

Its buffers are the checkpoint's tensors under the same local names (the contract and its one
validator live in `quantkit.format.tensors`), so `state_dict()` writes them back unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from quantkit.errors import SchemeError
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import check_module_tensors
from quantkit.format.weight_format import Codes
from quantkit.fused_kernels.packed_weights import packed_weights
from quantkit.fused_kernels.prepared_linear import PreparedLinear, prepare_linear

# Integer views that hide a float tensor from nn.Module's dtype casts (`_apply`).
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

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
        # The format's tensors, in its order: state_dict() (and so the checkpoint) keeps it.
        for local, t in scheme.format.empty(n, k, scheme, dtype=dtype, device=device).items():
            self.register_buffer(local, t)
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        scheme: QuantScheme,
        bias: torch.Tensor | None = None,
        validated: bool = False,
    ) -> QuantLinear:
        """A QuantLinear holding `tensors` (local checkpoint names) as they are, once validated.

        `validated=True`: the caller already ran `check_module_tensors` on exactly these
        tensors, bias included (the loader, after `load_checkpoint`), so it is not run again."""
        tensors = dict(tensors)
        if bias is not None:
            tensors["bias"] = bias
        if validated:
            n, k = scheme.format.shape(tensors)
        else:
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

        With `codes`/`scale`/`zero` (the format's codes: int8 for INT4, float8 for FP8) from a
        quantizer such as AWQ, those are packed as given; without them the weight is
        round-to-nearest quantized by its format. Scales are stored in `dtype` (default the
        weight's dtype).
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
        if codes is None:
            q = scheme.format.round_to_nearest(weight, scheme)
        else:
            q = Codes(codes, scale, zero)  # type: ignore[arg-type]
        tensors = scheme.format.pack(q, scheme, dtype=dtype)
        if bias is not None:
            tensors["bias"] = bias.detach().to(dtype)
        return cls.from_tensors(tensors, scheme=scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._prepared()(x)

    def _prepared(self) -> PreparedLinear:
        """The kernel the registry chose, bound to this layer's tensors: made on first use and
        again whenever a buffer is replaced (`.to()`, `load_state_dict(assign=True)`) or
        QUANTKIT_BACKEND changes.

        Checking the operands and choosing the kernel on every call cost ~15 us a linear, ~3 ms
        of a SmolLM2-135M decode step (210 linears); the FP8 cpu kernel also scans the weight
        for NaN codes once, here, not per call."""
        key = (*self._buffers.values(), os.environ.get("QUANTKIT_BACKEND"))
        cached = self.__dict__.get("_prepared_cache")
        if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        weights = packed_weights(self._buffers, scheme=self.scheme, in_features=self.in_features)
        prepared = prepare_linear(weights, scheme=self.scheme, bias=self.bias)
        # In __dict__, not as a submodule or buffer: state_dict() and .to() never see it.
        self.__dict__["_prepared_cache"] = (key, prepared)
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
        # longer the checkpoint's tensor), NVFP4's fp8 scales too and round its fp32 global
        # scales. Hide those (every float8 buffer, and the format's `fixed_dtypes`) as integers
        # of the same width while `fn` runs; devices still apply.
        fixed = self.scheme.format.fixed_dtypes
        hidden = {
            name: t.dtype
            for name, t in self._buffers.items()
            if t is not None
            and (t.dtype == torch.float8_e4m3fn or (name in fixed and t.is_floating_point()))
        }
        if not hidden:
            return super()._apply(fn, recurse)
        for name, dtype in hidden.items():
            self._buffers[name] = self._buffers[name].view(_SAME_WIDTH_INT[dtype.itemsize])
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, dtype in hidden.items():
                self._buffers[name] = self._buffers[name].view(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme.describe()}"
        )
