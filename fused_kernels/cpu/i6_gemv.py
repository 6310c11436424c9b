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
_ROWS = 4096  # weight rows rounded and packed at a time: ~0.3 GB of fp32 temporaries at K = 4096

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
    [tiles][groups][16]. Rounded and packed `_ROWS` rows at a time, and only the packed form
    is kept (`codes()` and `row_scales()` read it back): an 8B model's 128256 x 4096 head
    takes 427 MB, and making it from its bf16 weight raised peak RSS by 0.76 GB (the packed
    0.43 and the chunks' fp32 temporaries; 1.48 GB with 16384-row chunks)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"6-bit head: expected a width that is a multiple of {GROUP}, got {k}")
        self.out_features, self.in_features = n, k
        tiles, groups = (n + 15) // 16, k // GROUP
        self.packed = torch.empty(tiles, groups, 2, 3, 16, 4, dtype=torch.uint8)
        self.scales = torch.zeros(tiles, groups, 16, dtype=torch.float16)
        for r in range(0, n, _ROWS):  # _ROWS is a multiple of 16: whole tiles
            codes, scales = round_i6(weight[r : r + _ROWS])
            rows = codes.shape[0]
            t0, t1 = r // 16, r // 16 + (rows + 15) // 16
            pad = -rows % 16
            u = torch.full((rows + pad, k), 32, dtype=torch.uint8)
            u[:rows] = (codes.to(torch.int16) + 32).to(torch.uint8)
            self.packed[t0:t1] = _pack(u.view(t1 - t0, 16, k))
            s = torch.zeros(rows + pad, groups, dtype=torch.float16)
            s[:rows] = scales
            self.scales[t0:t1] = s.view(t1 - t0, 16, groups).transpose(1, 2)

    def nbytes(self) -> int:
        """Bytes a call reads: the packed codes and the scales (the padding rows included)."""
        return self.packed.numel() + self.scales.numel() * 2

    def codes(self) -> torch.Tensor:
        """The codes C (int8 [N, K], -31..31), read back from the packed layout."""
        p = self.packed
        a, b, c = p[:, :, :, 0], p[:, :, :, 1], p[:, :, :, 2]  # [tile, group, quad, row, elem]
        low = torch.stack([a & 15, a >> 4, b & 15, b >> 4], dim=3)  # [.., quad, word, row, e]
        top = torch.stack([(c >> (2 * w)) & 3 for w in range(4)], dim=3)
        u = (low | (top << 4)).to(torch.int16) - 32
        # [tile, group, quad, word, row, e] -> [tile, row, group, quad, word, e]
        u = u.permute(0, 4, 1, 2, 3, 5).reshape(-1, self.in_features)
        return u[: self.out_features].to(torch.int8)

    def row_scales(self) -> torch.Tensor:
        """The scales s (fp16 [N, K / 32])."""
        s = self.scales.transpose(1, 2).reshape(-1, self.in_features // GROUP)
        return s[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        """C * s, fp32 [N, K]."""
        s = self.row_scales().float().repeat_interleave(GROUP, dim=1)
        return self.codes().float() * s


def _pack(u: torch.Tensor) -> torch.Tensor:
    """Codes u = C + 32 (uint8 [tiles, 16, K]) in the kernel's layout [tiles, groups, 2, 3,
    16, 4]: per quad of words the low nibbles of words 0 and 1, of words 2 and 3, then the top
    two bits of all four."""
    tiles, _, k = u.shape
    # [tile, row l, group, quad h, word, element e] -> [tile, group, h, word, l, e]
    u = u.view(tiles, 16, k // GROUP, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    low, high = u & 15, u >> 4
    a = low[:, :, :, 0] | (low[:, :, :, 1] << 4)
    b = low[:, :, :, 2] | (low[:, :, :, 3] << 4)
    c = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4)
    c = c | (high[:, :, :, 3] << 6)
    return torch.stack([a, b, c], dim=3)


def i6_gemv(
    x: torch.Tensor,
    weight: I6Weight,
    *,
    out: torch.Tensor | None = None,
    best: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [M, N] = q(x) [M, K] @ (C * s).T: x fp32 [M, K] on the CPU with contiguous rows,
    1 <= M <= `I6_MAX_M`, quantized to int8 per block of 32. Written into `out` (fp32 [M, N],
    contiguous rows) when given. best: int64 [M, QK_TOP], each row's best columns as stored
    (`bf16_gemv.i8i8_gemv`'s)."""
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
        out.data_ptr(), out.stride(0), torch.get_num_threads(), cpu_launch.best_pointer(best, m),
    )  # fmt: skip
    cpu_launch.check_status(status, "6-bit head GEMV")
    return out
