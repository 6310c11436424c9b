"""NVFP4 and MXFP4 by their definitions, in float64 Python, element by element: the oracle of
`quantkit.format.nvfp4` / `.mxfp4` (tests/test_fp4_formats.py), written apart from them.

- E2M1: the nearest of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even index (mantissa bit 0),
  so values past 6 go to 6; the sign bit set for values < 0 (compressed-tensors' packing: a
  negative value that rounds to 0 is -0; -0.0 is +0). Byte j of a row holds element 2j in its
  low nibble and 2j + 1 in its high nibble.
- E4M3 (float8_e4m3fn): 3 mantissa bits, exponents -6..8, subnormals spaced 2^-9, nearest with
  ties to even, 448 the largest (no infinity: larger values saturate).
- NVFP4 (compressed-tensors' convention, with its fp32 roundings made explicit by `f32`): global
  scale g = f32(2688 * f32(1 / absmax)) (torch's `2688 / t`; 1 when not finite); group scale
  s = E4M3(f32(g * f32(absmax_group / 6))), 0.125 where it is 0; element code
  E2M1(f32(x / f32(s / g))); value f32(e2m1 * f32(s / g)).
- MXFP4 (OCP Microscaling v1.0): X = 2^(floor(log2(absmax_group)) - 2) clamped to
  2^-127..2^127 (2^-127 for a zero group), stored as the byte log2(X) + 127; code E2M1(x / X);
  value e2m1 * X (both exact).
"""

from __future__ import annotations

import math

import numpy as np

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
F32_TINY = 2.0**-126


def f32(v: float) -> float:
    """v rounded to the nearest float32 (a single fp64 operation rounded to fp32 is the fp32
    operation's result: fp64 has more than twice the bits)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def e2m1_code(v: float) -> int:
    a = min(abs(v), 6.0)  # saturate (also keeps a - 6 from rounding to a for huge v)
    index = min(range(8), key=lambda i: (abs(a - E2M1[i]), i % 2))
    return index | (8 if v < 0 else 0)


def e2m1_value(code: int) -> float:
    return -E2M1[code & 7] if code & 8 else E2M1[code & 7]


def e4m3(v: float) -> float:
    """v >= 0 rounded to float8_e4m3fn."""
    if v == 0:
        return 0.0
    exponent = max(math.frexp(v)[1] - 1, -6)
    quantum = 2.0 ** (exponent - 3)
    return min(round(v / quantum) * quantum, 448.0)  # round(): half to even


def pack(codes: list[list[int]]) -> list[list[int]]:
    return [[row[j] | (row[j + 1] << 4) for j in range(0, len(row), 2)] for row in codes]


def nvfp4(w: list[list[float]], g: float | None = None) -> dict[str, object]:
    """codes, group scales, global scale and values of W (rows of floats), on global scale g
    (default W's own)."""
    if g is None:
        absmax = max(abs(x) for row in w for x in row)
        # As torch evaluates a number over a tensor (compressed-tensors writes `448 * 6 / t`):
        # times the fp32 reciprocal.
        g = f32(2688.0 * f32(1.0 / max(absmax, F32_TINY)))
        if not math.isfinite(g):
            g = 1.0
    codes, scales, values = [], [], []
    for row in w:
        rc, rs, rv = [], [], []
        for start in range(0, len(row), 16):
            group = row[start : start + 16]
            s = e4m3(f32(g * f32(max(abs(x) for x in group) / 6.0)))
            s = 0.125 if s == 0 else s
            se = f32(s / g)
            cs = [e2m1_code(f32(x / se)) for x in group]
            rc += cs
            rs.append(s)
            rv += [f32(e2m1_value(c) * se) for c in cs]
        codes.append(rc)
        scales.append(rs)
        values.append(rv)
    return {"codes": codes, "scales": scales, "global": g, "values": values}


def mxfp4(w: list[list[float]]) -> dict[str, object]:
    """codes, biased exponents and values of W (rows of floats)."""
    codes, exponents, values = [], [], []
    for row in w:
        rc, re, rv = [], [], []
        for start in range(0, len(row), 32):
            group = row[start : start + 32]
            absmax = max(abs(x) for x in group)
            e = -127 if absmax == 0 else math.frexp(absmax)[1] - 1 - 2
            e = min(max(e, -127), 127)
            scale = 2.0**e
            cs = [e2m1_code(x / scale) for x in group]
            rc += cs
            re.append(e + 127)
            rv += [e2m1_value(c) * scale for c in cs]
        codes.append(rc)
        exponents.append(re)
        values.append(rv)
    return {"codes": codes, "exponents": exponents, "values": values}
