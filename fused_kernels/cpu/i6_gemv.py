"""The 6-bit lm_head GEMV (`csrc/i6_gemv.c`): a weight rounded to 6-bit codes with an fp16
scale per row and group of 32 elements, times up to 16 fp32 activation rows quantized to int8
per block of 32. `I6Weight` rounds and lays out a weight once (when the model loads); `i6_gemv`
multiplies. Needs AVX512-VNNI (`i6_gemv_available()`); elsewhere the caller keeps another head.
"""

from __future__ import annotations

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.cpu import launch as cpu_launch

__all__ = ["GROUP", "I6_MAX_M", "I6Weight", "i6_gemv", "i6_gemv_available"]

GROUP = 32  # elements a scale covers (and the activations' int8 block)
I6_MAX_M = 16  # rows one `qk_i6i8_gemv` call takes
_QMAX = 31  # codes -31..31, stored as u = code + 32
_ROWS = 16384  # weight rows rounded at a time (bounds the fp32 temporaries: 8B's head is 525M)

# csrc/i6_gemv.c, typed by `abi`: _library(variant=None).
_library = cpu_launch.library_loader("qk_i6_gemv")


def i6_gemv_available() -> bool:
    """True if the kernel builds and loads here and the CPU has AVX512-VNNI."""
    if not cpu_launch.loads(_library):
        return False
    return bool(_library().qk_i6i8_gemv_available())


def round_i6(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] (K a multiple of 32) as int8 codes C in -31..31 and fp16 scales s
    [N, K / 32], s = absmax / 31 of each group rounded to fp16, C = round(W / s) (0 where s is
    0): W ~ C * s."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"6-bit head: expected a width that is a multiple of {GROUP}, got {k}")
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GROUP, dtype=torch.float16)
    for r in range(0, n, _ROWS):
        w = weight[r : r + _ROWS].float().view(-1, k // GROUP, GROUP)
        s = (w.abs().amax(-1) / _QMAX).to(torch.float16)
        s32 = s.float().unsqueeze(-1)
        c = torch.where(s32 > 0, torch.round(w / torch.where(s32 > 0, s32, 1.0)), 0.0)
        codes[r : r + _ROWS] = c.clamp(-_QMAX, _QMAX).to(torch.int8).view(-1, k)
        scales[r : r + _ROWS] = s
    return codes, scales


class I6Weight:
    """A weight [N, K] in 6 bits, laid out for `qk_i6i8_gemv`: each tile of 16 rows (N padded
    with zero rows) per group of 32 elements as 384 bytes (i6_gemv.c: two quads of words, each
    the low 4 bits of two words per vector and the top 2 bits of four), the scales fp16
    [tiles][groups][16]. `dequantized()` gives C * s in fp32 (what the kernel multiplies by)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        codes, scales = round_i6(weight)
        self.codes, self.row_scales = codes, scales
        pad = -n % 16
        tiles, groups = (n + pad) // 16, k // GROUP
        u = torch.full((n + pad, k), 32, dtype=torch.uint8)
        u[:n] = (codes.to(torch.int16) + 32).to(torch.uint8)
        # [tile, row l, group, quad h, word k, element e] -> [tile, group, h, k, l, e]
        u = u.view(tiles, 16, groups, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
        low, high = u & 15, u >> 4
        a = low[:, :, :, 0] | (low[:, :, :, 1] << 4)
        b = low[:, :, :, 2] | (low[:, :, :, 3] << 4)
        c = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4)
        c = c | (high[:, :, :, 3] << 6)
        self.packed = torch.stack([a, b, c], dim=3).contiguous()  # [tile, group, h, 3, l, e]
        padded = torch.zeros(n + pad, groups, dtype=torch.float16)
        padded[:n] = scales
        self.scales = padded.view(tiles, 16, groups).transpose(1, 2).contiguous()

    def nbytes(self) -> int:
        """Bytes a call reads: the packed codes and the scales (the padding rows included)."""
        return self.packed.numel() + self.scales.numel() * 2

    def dequantized(self) -> torch.Tensor:
        """C * s, fp32 [N, K]."""
        n, k = self.codes.shape
        s = self.row_scales.float().repeat_interleave(GROUP, dim=1)
        return self.codes.float() * s.view(n, k)


def i6_gemv(x: torch.Tensor, weight: I6Weight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, N] = q(x) [M, K] @ (C * s).T: x fp32 [M, K] on the CPU with contiguous rows,
    1 <= M <= `I6_MAX_M`, quantized to int8 per block of 32. Written into `out` (fp32 [M, N],
    contiguous rows) when given."""
    if not i6_gemv_available():
        raise KernelUnavailableError("6-bit head GEMV: expected a CPU with AVX512-VNNI, got none")
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or not x.is_cpu:
        raise ValueError(
            f"x: expected fp32 [M, K] on the CPU with contiguous rows, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features or not 1 <= m <= I6_MAX_M:
        raise ValueError(
            f"x: expected 1 to {I6_MAX_M} rows of {weight.in_features}, got {tuple(x.shape)}"
        )
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out: expected fp32 [{m}, {n}] with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    status = _library().qk_i6i8_gemv(
        x.data_ptr(), m, k, x.stride(0), weight.packed.data_ptr(), weight.scales.data_ptr(), n,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    cpu_launch.check_status(status, "6-bit head GEMV")
    return out
