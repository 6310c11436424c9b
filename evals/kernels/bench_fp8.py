"""The FP8 rows of the kernel benchmark (`bench --impls fp8,fp8-w8a8[,scaled-mm]`).

- `fp8`: W8A16 as `QuantLinear` runs it (`prepare_fp8` + call: triton on CUDA, the C GEMV /
  dequantize + MKL on CPU).
- `fp8-w8a8`: dynamic per-token W8A8, the activation quantization included in the time (on CPU
  emulated with the GPU kernel's numerics; on a GPU before sm_89 it runs as W8A16 and the label
  says so).
- `scaled-mm` (CUDA): `torch._scaled_mm` with row-wise scales on activations quantized
  beforehand (the matmul alone: the ceiling the W8A8 GEMM is compared with at M = 2048).

Weight bytes: the fp8 weight (N*K) + the scales. Layer copies are sized like the INT4 ones (at
least --sweep-mb of weights per timed sweep) so every call reads its weights from memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.prepared_linear import PreparedLinear as PreparedFp8
from quantkit.fused_kernels.prepared_linear import prepare_fp8

FP8_IMPLS = ("fp8", "fp8-w8a8", "scaled-mm")
_W8A16 = QuantScheme("fp8")
_W8A8 = QuantScheme("fp8", activations="dynamic")


def _random_fp8(n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """Random finite fp8 weights (codes 0x7F / 0xFF, NaN, excluded) and per-row scales."""
    codes = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, device=device)
    codes |= torch.randint(0, 2, (n, k), dtype=torch.uint8, device=device) << 7
    scale = (torch.rand(n, 1, device=device) * 0.01 + 1e-3).to(dtype)
    return codes.view(torch.float8_e4m3fn), scale


def fp8_op(
    impl: str,
    x: torch.Tensor,
    n: int,
    k: int,
    *,
    cache: dict,
    sweep_bytes: int,
) -> tuple[Callable[[int], object], int, str]:
    """(call on copy c, weight bytes a call reads, label) for one FP8 implementation.

    `cache` (one per shape) keeps the layer copies across row counts M."""
    if "fp8-layers" not in cache:
        nbytes = n * k + n * x.dtype.itemsize
        copies = max(1, min(4096, math.ceil(sweep_bytes / nbytes)))
        cache["fp8-layers"] = [_random_fp8(n, k, x.device, x.dtype) for _ in range(copies)]
    layers = cache["fp8-layers"]
    copies = len(layers)
    if impl == "scaled-mm":
        if x.device.type != "cuda":
            raise SystemExit("--impls scaled-mm: expected a CUDA device (torch._scaled_mm)")
        from quantkit.format.packing import quantize_fp8_per_token

        x8, sx = quantize_fp8_per_token(x)
        scales = [s.float().reshape(1, n) for _, s in layers]

        def run(c: int) -> object:
            w8 = layers[c % copies][0]
            return torch._scaled_mm(
                x8, w8.T, scale_a=sx, scale_b=scales[c % copies], out_dtype=x.dtype
            )

        return run, n * k + n * 4, "scaled-mm"
    scheme = _W8A8 if impl == "fp8-w8a8" else _W8A16
    key = f"{impl}-prepared"
    if key not in cache:
        cache[key] = [prepare_fp8(w, s, scheme=scheme) for w, s in layers]
    prepared: list[PreparedFp8] = cache[key]
    first = prepared[0]
    label = f"{impl} {first.backend}"
    if impl == "fp8-w8a8" and not first.act_dynamic:
        label = f"fp8 {first.backend} (no w8a8)"
    return (lambda c: prepared[c % copies](x)), first.nbytes, label
