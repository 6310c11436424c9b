"""FP4 E2M1, the element type of NVFP4 and MXFP4: the grid, rounding onto it, the nibble codes and
their packing, once, in pure torch. The two formats differ only in their scales
(`quantkit.format.nvfp4`, `quantkit.format.mxfp4`); `Fp4Format` is what they share.

- E2M1 magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (1 sign, 2 exponent, 1 mantissa bit, no Inf/NaN).
- A code is a nibble: bit 3 the sign, bits 0-2 the index of the magnitude above. A value is
  rounded to the nearest magnitude, ties to the even index (the one with mantissa bit 0:
  0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturates at 6.
  A negative value that rounds to 0 keeps its sign (code 8, -0), as compressed-tensors writes
  it; -0.0 itself is +0.
- `weight_packed` uint8 [N, K/2]: element 2j of a row in the low nibble of byte j, element 2j+1
  in the high nibble (compressed-tensors `pack_fp4_to_uint8`, vLLM's reading order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.weight_format import SchemeView, WeightFormat, check_tensor

E2M1_MAX = 6.0
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 0x8
# The midpoint between magnitude i and i + 1, and whether a value exactly on it goes up: it goes
# to the even index, so up from an odd index only.
_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 nibble codes of x (already divided by its scale): round to nearest even onto the
    E2M1 grid, saturating at +-6."""
    a = x.float().abs()
    index = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for midpoint, tie_up in _MIDPOINTS:
        index += (a >= midpoint if tie_up else a > midpoint).to(torch.uint8)
    return index | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 nibble codes (exact)."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & SIGN_BIT) != 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (K even) -> uint8 [N, K/2], element 2j in the low nibble of byte j."""
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(
            f"codes: expected a 2-D [N, K] tensor with K even, got {tuple(codes.shape)}"
        )
    c = codes.to(torch.uint8) & 0xF
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 nibble codes [N, K] (inverse of `pack_fp4`)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed: expected 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., K] -> [..., K/G, G]."""
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the last dimension {k}")
    return x.reshape(*x.shape[:-1], k // group_size, group_size)


def fp4_dequantize(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [..., K] = value(code) * scale, the scale [..., K/G] (fp32) per group of G."""
    values = grouped(e2m1_values(codes), group_size) * scale.float().unsqueeze(-1)
    return values.reshape(codes.shape)


class Fp4Format(WeightFormat):
    """What NVFP4 and MXFP4 share: E2M1 codes two to a byte in `weight_packed`, one scale per
    fixed group of input channels in `weight_scale` (its dtype the format's), always symmetric.
    `dequantize` of the subclass's codes and scales; the C step and row fusion do not apply."""

    bits = 4
    grouped = True
    c_step = False
    ct_type = "float"
    named_by_bits = False  # --bits 4 means int4; FP4 is named with --format only
    group: int  # the one group size the format defines

    scale_dtype: torch.dtype  # of `weight_scale`

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.fixed_group = cls.group

    def _group_size(self, scheme: SchemeView) -> int:
        if scheme.group_size not in ("auto", self.group):
            raise SchemeError(
                f"group_size: {self.kind} defines groups of {self.group} input channels, "
                f"expected {self.group} or auto, got {scheme.group_size!r}"
            )
        return self.group

    def _packed_shape(
        self, tensors: Mapping[str, torch.Tensor], name: Callable[[str], str]
    ) -> tuple[int, int]:
        """(N, K) from `weight_packed` uint8 [N, K/2], K a multiple of the group; the scales
        checked against it."""
        packed = tensors["weight_packed"]
        if packed.dim() != 2:
            raise CheckpointError(
                f"tensor {name('weight_packed')}: expected 2-D [N, K/2], got {tuple(packed.shape)}"
            )
        n, k = packed.shape[0], 2 * packed.shape[1]
        check_tensor(name("weight_packed"), packed, (n, k // 2), (torch.uint8,))
        if n == 0 or k % self.group:
            raise CheckpointError(
                f"tensor {name('weight_packed')}: expected N > 0 and K = 2 x columns divisible "
                f"by {self.group} ({self.kind}), got N={n}, K={k}"
            )
        check_tensor(
            name("weight_scale"), tensors["weight_scale"], (n, k // self.group), (self.scale_dtype,)
        )
        return n, k

    def shape(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        packed = tensors["weight_packed"]
        return packed.shape[0], 2 * packed.shape[1]

    def _empty(self, n: int, k: int, device: Any) -> dict[str, torch.Tensor | None]:
        return {
            "weight_packed": torch.empty(n, k // 2, dtype=torch.uint8, device=device),
            "weight_scale": torch.empty(n, k // self.group, dtype=self.scale_dtype, device=device),
        }
