"""The quantization math and the bit layout, once, in pure torch.

Everything that turns weights into codes or codes back into weights calls this module: the RTN
and AWQ quantizers (AWQ's search uses `fake_quantize_int4`), the checkpoint writer and loader,
and every kernel's pure-torch reference. The Triton unpack must agree with `unpack_int4`
bit-exactly (tested).

INT4, compressed-tensors `pack-quantized` layout, for a Linear weight W [N = out, K = in] with
groups of G input channels (G = K for per-channel):

- scale s [N, K/G] (model dtype); zero point zp [N, K/G], integers in [-8, 7] (asymmetric only).
- codes q = clamp(round(W / s + zp), -8, 7); symmetric schemes use zp = 0 and codes in [-7, 7]
  (s = absmax / 7, so the largest weight of a group is exact).
- dequantize: W ~= (q - zp) * s.
- `weight_packed` int32 [N, ceil(K/8)]: the nibble q + 8 of element j of a row sits in word
  j // 8 at bits 4 * (j % 8), lowest nibble first; a word is the uint32 bit pattern stored as
  int32, so it can be negative.
- `weight_zero_point` int32 [ceil(N/8), K/G]: nibble zp + 8, packed along dim 0: row 8i + k of
  group g sits in word [i, g] at bits 4k.

FP8 (compressed-tensors `float-quantized`): W [N, K] as float8_e4m3fn with a per-output-channel
scale s [N, 1] = row absmax / 448 (448 is E4M3's largest finite value); W ~= w8 * s.

INT8 per row (`int8_absmax`, the runtime's formats: the int8 KV cache and the int8 lm_head,
and the per-token activations of W8A8 INT8): s = row absmax / 127, codes round(x / s) in
[-127, 127]; x ~= q * s.

INT8 W8A8 (compressed-tensors `int-quantized`): W [N, K] as int8 codes with a per-output-channel
scale s [N, 1] = row absmax / 127 (`int8_row_scale`, `int8_codes`); W ~= q * s. Activations are
quantized per token at run time with `int8_absmax`. (compressed-tensors' own observers use
absmax / 127.5 and codes in [-128, 127]; such a checkpoint reads and runs the same.)
"""

from __future__ import annotations

import torch

INT4_MIN = -8
INT4_MAX = 7
FP8_MAX = 448.0
# Smallest scale we allow: a group of zeros would otherwise divide by zero.
_EPS = 1e-10


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, K/G, G] (G = K when group_size is -1)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"group_size {g} does not divide in_features {k}")
    return w.reshape(n, k // g, g)


def int4_qparams(
    w: torch.Tensor,
    *,
    group_size: int,
    symmetric: bool,
    clip_ratio: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale [N, K/G] (fp32) and zero point [N, K/G] (int32, or None if symmetric) for W [N, K].

    `clip_ratio` (scalar or [N, K/G]) shrinks each group's range before the scale is chosen;
    AWQ's clipping search tries ratios below 1 to trade outlier error for resolution.
    """
    wg = _grouped(w.float(), group_size)
    ratio = torch.as_tensor(clip_ratio, dtype=torch.float32, device=w.device)
    if symmetric:
        absmax = wg.abs().amax(dim=-1) * ratio
        return (absmax / INT4_MAX).clamp(min=_EPS), None
    # The range always contains 0 so that zp lands in [-8, 7] and zeros stay exact.
    wmax = wg.amax(dim=-1).clamp(min=0) * ratio
    wmin = wg.amin(dim=-1).clamp(max=0) * ratio
    scale = ((wmax - wmin) / (INT4_MAX - INT4_MIN)).clamp(min=_EPS)
    zero = (torch.round(-wmin / scale) + INT4_MIN).clamp(INT4_MIN, INT4_MAX).to(torch.int32)
    return scale, zero


def int4_quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, *, group_size: int
) -> torch.Tensor:
    """Codes int8 [N, K] in [-8, 7]: clamp(round(W / s + zp), -8, 7)."""
    wg = _grouped(w.float(), group_size)
    x = wg / scale.float().unsqueeze(-1)
    if zero is not None:
        x = x + zero.float().unsqueeze(-1)
    q = torch.round(x).clamp(INT4_MIN, INT4_MAX)
    return q.reshape(w.shape).to(torch.int8)


def int4_dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    *,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W [N, K] = (q - zp) * s, computed in fp32 and returned in `dtype`."""
    qg = _grouped(codes.float(), group_size)
    if zero is not None:
        qg = qg - zero.float().unsqueeze(-1)
    w = qg * scale.float().unsqueeze(-1)
    return w.reshape(codes.shape).to(dtype)


def fake_quantize_int4(
    w: torch.Tensor,
    *,
    group_size: int,
    symmetric: bool,
    clip_ratio: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Quantize then dequantize, in w's dtype: what the model will compute with after packing."""
    scale, zero = int4_qparams(w, group_size=group_size, symmetric=symmetric, clip_ratio=clip_ratio)
    codes = int4_quantize(w, scale, zero, group_size=group_size)
    return int4_dequantize(codes, scale, zero, group_size=group_size, dtype=w.dtype)


INT8_MAX = 127


# Elements `int8_absmax` rounds at a time: a large matrix (an 8B model's 128256 x 4096 head,
# 2.1 GB in fp32) is rounded a block of rows at a time, so its fp32 temporaries are one block's
# (the whole-matrix arithmetic held four copies: 17.4 GB peak loading that model).
INT8_BLOCK_ELEMENTS = 2**24


def _int8_absmax_rows(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = xf.abs().amax(-1, keepdim=True) / INT8_MAX
    q = xf / scale.clamp_min(torch.finfo(torch.float32).tiny)
    return q.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (codes int8 [..., n], scale fp32 [..., 1]): each row's absmax / 127, and
    round(x / scale) to nearest even (an all-zero row: scale 0, codes 0). Rows are independent:
    a large x is done `INT8_BLOCK_ELEMENTS` at a time, with the same result."""
    n = x.shape[-1] if x.dim() else 1
    if x.numel() <= INT8_BLOCK_ELEMENTS or n == 0 or n > INT8_BLOCK_ELEMENTS:
        return _int8_absmax_rows(x.float())
    rows = x.reshape(-1, n)
    codes = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    step = INT8_BLOCK_ELEMENTS // n
    for r in range(0, rows.shape[0], step):
        codes[r : r + step], scale[r : r + step] = _int8_absmax_rows(rows[r : r + step].float())
    return codes.view(x.shape), scale.view(*x.shape[:-1], 1)


def _to_int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bit pattern."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> int32 [N, ceil(K/8)], lowest nibble first."""
    if codes.dim() != 2:
        raise ValueError(f"expected 2-D codes [N, K], got shape {tuple(codes.shape)}")
    n, k = codes.shape
    nib = (codes.to(torch.int64) - INT4_MIN) & 0xF
    pad = (-k) % 8
    if pad:
        nib = torch.nn.functional.pad(nib, (0, pad))
    nib = nib.reshape(n, -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    return _to_int32_bits((nib << shifts).sum(dim=-1))


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] -> int8 codes [N, K] in [-8, 7] (inverse of `pack_int4`)."""
    n, words = packed.shape
    if words != (k + 7) // 8:
        raise ValueError(f"expected {(k + 7) // 8} packed words per row for K={k}, got {words}")
    bits = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nib = (bits.unsqueeze(-1) >> shifts) & 0xF
    return (nib.reshape(n, -1)[:, :k] + INT4_MIN).to(torch.int8)


def pack_zero_points(zero: torch.Tensor) -> torch.Tensor:
    """int zero points [N, G] in [-8, 7] -> int32 [ceil(N/8), G], packed along dim 0."""
    n, g = zero.shape
    nib = (zero.to(torch.int64) - INT4_MIN) & 0xF
    pad = (-n) % 8
    if pad:
        nib = torch.nn.functional.pad(nib, (0, 0, 0, pad))
    nib = nib.reshape(-1, 8, g)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=zero.device).view(1, 8, 1)
    return _to_int32_bits((nib << shifts).sum(dim=1))


def unpack_zero_points(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [ceil(N/8), G] -> int32 zero points [N, G] (inverse of `pack_zero_points`)."""
    rows, g = packed.shape
    if rows != (n + 7) // 8:
        raise ValueError(f"expected {(n + 7) // 8} packed zero-point rows for N={n}, got {rows}")
    bits = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device).view(1, 8, 1)
    nib = (bits.unsqueeze(1) >> shifts) & 0xF
    return (nib.reshape(-1, g)[:n] + INT4_MIN).to(torch.int32)


def fp8_row_scale(w: torch.Tensor) -> torch.Tensor:
    """fp32 scale [N, 1] = row absmax / 448 of W [N, K]: the largest weight of a row is exact."""
    return (w.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_EPS)


def fp8_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of W [N, K] (or a column block [N, m]) on a fixed scale [N, 1]:
    W / s rounded to nearest, clamped to +-448 (a scale stored in bf16 can be a hair below
    absmax / 448, and GPTQ's error updates can push a weight past the row's absmax)."""
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (float8_e4m3fn [N, K], fp32 scale [N, 1] = row absmax / 448)."""
    scale = fp8_row_scale(w)
    return fp8_codes(w, scale), scale


def dequantize_fp8(
    w8: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [N, K] = w8 * s, in `dtype`."""
    return (w8.float() * scale.float()).to(dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization for W8A8: x [..., K] -> (fp8, fp32 scale [..., 1])."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_EPS)
    x8 = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x8, scale


def dequantize_packed_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    in_features: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """compressed-tensors pack-quantized tensors -> dense W [N, K] in `dtype`."""
    n = weight_packed.shape[0]
    codes = unpack_int4(weight_packed, in_features)
    zero = None if weight_zero_point is None else unpack_zero_points(weight_zero_point, n)
    return int4_dequantize(codes, weight_scale, zero, group_size=group_size, dtype=dtype)


def int8_row_scale(w: torch.Tensor) -> torch.Tensor:
    """fp32 scale [N, 1] = row absmax / 127 of W [N, K]: the largest weight of a row is exact."""
    return (w.float().abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=_EPS)


def int8_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of W [N, K] (or a column block [N, m]) on a fixed scale [N, 1]: W / s rounded
    to nearest even, clamped to +-127 (a scale stored in bf16 can be a hair below absmax / 127,
    and GPTQ's error updates can push a weight past the row's absmax)."""
    q = torch.round(w.float() / scale.float())
    return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_int8(
    w8: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [N, K] = q * s, in `dtype`."""
    return (w8.float() * scale.float()).to(dtype)
