"""One matmul for Linears that read the same input: the family's `fused` groups (q/k/v and
gate/up for every family so far; `model.family.fused` says which, in what order, and where the
decoder reads the fused module).

A decode step of a small model is dominated by per-call overhead, not by bytes: SmolLM2-135M's
576x192 k_proj GEMV takes ~5 us in the kernel and ~13 us as a module call. Concatenating the
weights of the projections that share an input (along N) turns 7 Linears a layer into 4.

No memory is duplicated: the parts' tensors are replaced by row views of the fused tensors, so
the model's modules, names and `state_dict()` are unchanged and the fused module reads the
same bytes. A part whose tensors are later replaced (`.to()`, `load_state_dict(assign=True)`)
no longer matches its view; `FusedLinear.valid()` then says so and the model falls back to the
separate calls.

Fusable: dense `nn.Linear`s of one dtype, or INT4 `QuantLinear`s of one scheme and scale dtype
whose row counts are multiples of 8 (the zero points pack 8 rows into an int32 word). FP8 and
anything mixed stay separate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from quantkit.runtime.quant_linear import QuantLinear

__all__ = ["FusedLinear", "fuse", "fuse_projections"]

# QuantLinear tensors that are concatenated along N (weight_shape is per part).
_INT4_ROWS = ("weight_packed", "weight_scale", "bias")


class FusedLinear(nn.Module):
    """y = cat([part(x) for part in parts], -1) as one matmul; `sizes` are the parts' N."""

    def __init__(self, fused: nn.Module, parts: Sequence[nn.Module], views: list[tuple]) -> None:
        super().__init__()
        self.fused = fused
        self.sizes = [p.out_features for p in parts]
        # Plain attributes, not submodules: the parts belong to the model, not to this.
        self.__dict__["_parts"] = tuple(parts)
        self.__dict__["_views"] = views

    def valid(self) -> bool:
        """True while every part still holds the views this was built from."""
        return all(
            getattr(part, name) is view
            for part, names in zip(self._parts, self._views, strict=True)
            for name, view in names
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)


def fuse(parts: Sequence[nn.Module]) -> FusedLinear | None:
    """A FusedLinear over `parts` (Linears with the same input), or None if they cannot fuse."""
    if len(parts) < 2 or len({p.in_features for p in parts}) != 1:
        return None
    if all(type(p) is nn.Linear for p in parts):
        return _fuse_dense(parts)
    if all(isinstance(p, QuantLinear) and p.scheme.format.c_step for p in parts):
        return _fuse_int4(parts)  # type: ignore[arg-type]
    return None


def _fuse_dense(parts: Sequence[nn.Module]) -> FusedLinear | None:
    weights = [p.weight for p in parts]
    biases = [p.bias for p in parts]
    if len({(w.dtype, w.device) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    fused = nn.Linear(parts[0].in_features, weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    views: list[tuple] = []
    row = 0
    for part in parts:
        n = part.out_features
        part.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        names = [("weight", part.weight)]
        if bias is not None:
            part.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
            names.append(("bias", part.bias))
        views.append(tuple(names))
        row += n
    return FusedLinear(fused, parts, views)


def _fuse_int4(parts: Sequence[QuantLinear]) -> FusedLinear | None:
    first = parts[0]
    if any(p.scheme != first.scheme for p in parts):
        return None
    if len({p.weight_scale.dtype for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return None
    asymmetric = first.weight_zero_point is not None
    if asymmetric and any(p.out_features % 8 for p in parts):
        return None
    names = [n for n in _INT4_ROWS if getattr(first, n) is not None]
    if asymmetric:
        names.append("weight_zero_point")
    with torch.no_grad():
        cat = {n: torch.cat([getattr(p, n) for p in parts]) for n in names}
    total = sum(p.out_features for p in parts)
    tensors = {k: v for k, v in cat.items() if k != "bias"}
    tensors["weight_shape"] = torch.tensor([total, first.in_features], dtype=torch.int64)
    fused = QuantLinear.from_tensors(tensors, scheme=first.scheme, bias=cat.get("bias"))
    views: list[tuple] = []
    row = 0
    for part in parts:
        n = part.out_features
        spans = {name: (row, row + n) for name in names}
        if asymmetric:
            spans["weight_zero_point"] = (row // 8, (row + n) // 8)
        for name, (a, b) in spans.items():
            setattr(part, name, getattr(fused, name)[a:b])
        part.__dict__.pop("_prepared_cache", None)  # it would keep the replaced tensors alive
        views.append(tuple((name, getattr(part, name)) for name in spans))
        row += n
    return FusedLinear(fused, parts, views)


def fuse_projections(model: nn.Module) -> int:
    """Fuse the family's groups (`model.family.fused`: q/k/v, gate/up) of every decoder layer
    of a `CausalLM` where possible; return how many groups were fused. The model uses them while
    `valid()`; calling again is a no-op for groups that are still valid."""
    count = 0
    for layer in model.model.layers:
        for group in model.family.fused:
            owner_name, _, attr = group.into.rpartition(".")
            owner = layer.get_submodule(owner_name)
            parts = [layer.get_submodule(name) for name in group.linears]
            current = owner.__dict__.get(attr)
            if current is None or not current.valid():
                current = fuse(parts)
            # object.__setattr__: a Module assigned normally would become a submodule and
            # show up in state_dict().
            object.__setattr__(owner, attr, current)
            count += current is not None
    return count
