"""The KV cache and the formats it can store K and V in.

`KVCache` is one layer's static, preallocated K/V, [B, Hkv, S, E]: row b, head h, slot s holds
one head of one token in E storage elements. The format (`KVFormat`, named by `--kv-dtype`):

- `float32`, `bfloat16`, `float16`: the values themselves, E = D;
- `int8`: D int8 codes, then that head's fp32 scale amax / 127 as 4 more bytes, E = D + 4; the
  value is code * scale;
- `fp8`: D float8 e4m3 codes (stored as uint8), then the fp32 scale amax / 448, E = D + 4.

The scale rides with its codes, so every copy of a slice of the cache (the prefix cache, the
serving engine's slot windows) carries the scales along with no extra bookkeeping, and the C
decode step (`fused_kernels/csrc/attend.c`) reads the same bytes. The scaled formats quantize
each head of each token on its own, when it is written: absmax per (token, head) bounds the
error per element by scale / 2 (int8) or by 2^-4 of the value plus 2^-10 of the scale (e4m3:
3 mantissa bits, subnormals below 2^-6). Both paths compute a code the same way (`pack`), so
they write the same bytes for the same K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.errors import GenerationError
from quantkit.format.packing import int8_absmax

__all__ = ["KV_DTYPE_NAMES", "KVCache", "KVFormat", "kv_format"]

_TINY = torch.finfo(torch.float32).tiny  # the divisor for an all-zero head (its codes are 0)


@dataclass(frozen=True)
class KVFormat:
    """How one head of one token is stored: `storage` elements, scaled by their own absmax
    when `qmax` is set (`code` is the C step's `kv_dt`; None where it has none)."""

    name: str
    storage: torch.dtype
    qmax: float | None = None
    code: int | None = None

    @property
    def scaled(self) -> bool:
        return self.qmax is not None

    def width(self, head_dim: int) -> int:
        """Storage elements per head and token (E)."""
        return head_dim + 4 if self.scaled else head_dim

    def bytes_per_head(self, head_dim: int) -> int:
        return self.width(head_dim) * self.storage.itemsize

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (any float dtype) -> its stored form [..., E]."""
        if not self.scaled:
            return x.to(self.storage)
        if self.storage == torch.int8:
            codes, scale = int8_absmax(x)
        else:
            xf = x.float()
            scale = xf.abs().amax(-1, keepdim=True) / self.qmax
            q = xf / scale.clamp_min(_TINY)
            codes = q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([codes, scale.view(self.storage)], dim=-1)

    def unpack(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored form [..., E] -> values [..., D] in `dtype`."""
        if not self.scaled:
            return stored.to(dtype)
        d = stored.shape[-1] - 4
        codes, scale = stored[..., :d], stored[..., d:].contiguous().view(torch.float32)
        if self.storage == torch.int8:
            values = codes.float()
        else:
            values = codes.view(torch.float8_e4m3fn).float()
        return (values * scale).to(dtype)


_FORMATS = {
    "float32": KVFormat("float32", torch.float32, code=0),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, code=1),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, qmax=127.0, code=2),
    "fp8": KVFormat("fp8", torch.uint8, qmax=448.0, code=3),
}
# What `--kv-dtype` may name besides `auto` (the model's own dtype).
KV_DTYPE_NAMES = ("float32", "bfloat16", "int8", "fp8")


def kv_format(name: str | None, model_dtype: torch.dtype) -> KVFormat:
    """The format `name` means; None or "auto": the model's dtype, unquantized."""
    if name in (None, "auto"):
        name = str(model_dtype).removeprefix("torch.")
    if name not in _FORMATS:
        raise GenerationError(
            f"kv dtype: expected one of auto, {', '.join(KV_DTYPE_NAMES)}, got {name!r}"
        )
    return _FORMATS[name]


class KVCache(nn.Module):
    """Static, preallocated K/V for one layer: [B, Hkv, S, E] in `fmt` (see the module
    docstring), written at explicit positions; reads give values in `dtype`."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fmt: KVFormat | None = None,
    ) -> None:
        super().__init__()
        self.fmt = fmt or kv_format(None, dtype)
        self.dtype, self.head_dim = dtype, head_dim
        shape = (batch, kv_heads, max_len, self.fmt.width(head_dim))
        for name in ("k", "v"):
            empty = torch.zeros(shape, dtype=self.fmt.storage, device=device)
            self.register_buffer(name, empty, persistent=False)

    def values(self, stored: torch.Tensor) -> torch.Tensor:
        """A slice of `k` or `v` as values [..., D] in the model's dtype (a view when the
        cache stores that dtype)."""
        if stored.dtype == self.dtype and not self.fmt.scaled:
            return stored
        return self.fmt.unpack(stored, self.dtype)

    def update(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, Hkv, D] at positions [B, T]; return the whole cache's values."""
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        # Index the (B, S) axes together: each row writes at its own positions.
        self.k.permute(0, 2, 1, 3)[rows, positions] = self.fmt.pack(k)
        self.v.permute(0, 2, 1, 3)[rows, positions] = self.fmt.pack(v)
        return self.values(self.k), self.values(self.v)

    def write_span(
        self, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row (B = 1) whose T new tokens sit at slots start..start+T-1: two slice copies
        instead of two index_puts. Returns the values of slots 0..start+T-1."""
        end = start + k.shape[1]
        self.k[0, :, start:end].copy_(self.fmt.pack(k[0].transpose(0, 1)))
        self.v[0, :, start:end].copy_(self.fmt.pack(v[0].transpose(0, 1)))
        return self.values(self.k[:, :, :end]), self.values(self.v[:, :, :end])
