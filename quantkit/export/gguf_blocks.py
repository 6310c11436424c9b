"""llama.cpp's block formats, written from codes quantkit chose (never rounded a second time).

Every block covers 32 consecutive weights of one row; a row of K weights is K/32 blocks, stored
one after another, so a Linear [N, K] becomes uint8 [N, K/32 * block bytes]:

- Q4_0 (18 bytes): fp16 d, then 16 bytes where byte j holds weight j in its low nibble and
  weight j + 16 in its high nibble; weight = (nibble - 8) * d.
- Q4_1 (20 bytes): fp16 d, fp16 m, the same 16 bytes; weight = nibble * d + m.
- Q8_0 (34 bytes): fp16 d, 32 int8 q; weight = q * d (dense tensors only, rounded by the `gguf`
  package's own Q8_0, which mirrors llama.cpp's).

quantkit's INT4 codes q in [-8, 7] with zero point zp and group scale s (W = (q - zp) * s)
map onto them group by group: a group of G = 32 * r weights is r blocks with the same scale.
Q4_0 takes nibble q + 8 and d = s, exact when s is an fp16 value (symmetric codes, zp = 0).
Q4_1 takes nibble q + 8, d = s and m = -(zp + 8) * s, which fp16 rounds (a relative 2^-11 of
m, a few thousandths of one quantization step). `Exactness` reports both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quantkit.errors import ExportError

QK = 32  # weights per block, every block format here


@dataclass
class Exactness:
    """How far the written blocks are from the checkpoint's weights, over every Linear."""

    weights: int = 0
    scales_rounded: int = 0  # group scales that fp16 could not hold exactly
    max_step_error: float = 0.0  # the largest |written - checkpoint| over its group's scale

    def add(self, other: Exactness) -> None:
        self.weights += other.weights
        self.scales_rounded += other.scales_rounded
        self.max_step_error = max(self.max_step_error, other.max_step_error)

    @property
    def exact(self) -> bool:
        return self.scales_rounded == 0 and self.max_step_error == 0.0


def _per_block(values: torch.Tensor, k: int) -> torch.Tensor:
    """[N, groups] group values -> [N, K/32], one per block."""
    groups = values.shape[1]
    return values.repeat_interleave(k // QK // groups, dim=1)


def _nibbles(codes: torch.Tensor) -> np.ndarray:
    """int8 codes [N, K] in [-8, 7] -> the 16 packed bytes of each block, uint8 [N, K/32, 16]."""
    n, k = codes.shape
    nib = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(n, k // QK, QK)
    return (nib[..., :16] | (nib[..., 16:] << 4)).numpy()


def _fp16_bytes(x: torch.Tensor) -> np.ndarray:
    """fp16 [N, B] -> its bytes, uint8 [N, B, 2] (little-endian, as GGUF stores them)."""
    return x.numpy().astype("<f2").view(np.uint8).reshape(*x.shape, 2)


def check_blockable(k: int, group: int, where: str) -> None:
    """An ExportError unless K and the group size fit whole 32-weight blocks."""
    if k % QK or group % QK:
        raise ExportError(
            f"{where}: expected K and the group size to be multiples of {QK} (GGUF blocks), "
            f"got K={k}, group size {group}"
        )


def int4_blocks(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    *,
    qtype: str,
    where: str,
) -> tuple[np.ndarray, Exactness]:
    """One INT4 Linear's codes [N, K], scales [N, groups] and zero points (None: symmetric) as
    Q4_0 or Q4_1 blocks, uint8 [N, K/32 * bytes], with how exactly they hold the weights."""
    n, k = codes.shape
    check_blockable(k, k // scale.shape[1], where)
    s = scale.float()
    d = _per_block(s, k).to(torch.float16)
    d32 = d.float()
    report = Exactness(weights=n * k)
    report.scales_rounded = int((s.to(torch.float16).float() != s).sum())
    parts = [_fp16_bytes(d)]
    if qtype == "q4_0":
        if zero is not None:
            raise ExportError(
                f"{where}: q4_0 holds symmetric codes (no zero point), got an asymmetric "
                "checkpoint: export it as q4_1, or quantize with --symmetric"
            )
        written = torch.zeros_like(d32)  # the block's offset: none
        wanted = torch.zeros_like(d32)
    elif qtype == "q4_1":
        zp = torch.zeros_like(s) if zero is None else zero.float()
        m_exact = _per_block(-(zp + 8) * s, k)
        m = m_exact.to(torch.float16)
        parts.append(_fp16_bytes(m))
        written, wanted = m.float(), m_exact
    else:
        raise ExportError(f"{where}: expected q4_0 or q4_1 for INT4 codes, got {qtype!r}")
    parts.append(_nibbles(codes))
    blocks = np.concatenate(parts, axis=2).reshape(n, -1)
    # Per block, written - checkpoint = (d16 - s) * nibble + (m16 - m): bounded by its maximum
    # over nibbles 0 and 15, in units of the block's scale.
    sb = _per_block(s, k)
    scale_err = (d32 - sb).abs() * 15
    step = ((written - wanted).abs() + scale_err) / sb.clamp_min(torch.finfo(torch.float32).tiny)
    report.max_step_error = float(step.max()) if step.numel() else 0.0
    return blocks, report


def mxfp4_blocks(codes: torch.Tensor, exponents: torch.Tensor, *, where: str) -> np.ndarray:
    """One MXFP4 Linear's E2M1 nibble codes [N, K] (uint8, sign in bit 3) and E8M0 exponents
    [N, K/32] as ggml's MXFP4 blocks (17 bytes: the exponent byte, then byte j = weight j low,
    weight j + 16 high), uint8 [N, K/32 * 17]. ggml's table holds E2M1 doubled with half the
    scale, so the same nibble and exponent mean the same weight: always exact."""
    n, k = codes.shape
    check_blockable(k, QK, where)
    c = codes.to(torch.uint8).reshape(n, k // QK, QK)
    qs = (c[..., :16] | (c[..., 16:] << 4)).numpy()
    e = exponents.to(torch.uint8).reshape(n, k // QK, 1).numpy()
    return np.concatenate([e, qs], axis=2).reshape(n, -1)
