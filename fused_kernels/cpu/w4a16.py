"""CPU W4A16 linear: a compiled C GEMV for decode, dequantize + MKL for prefill.

y [..., N] = x [..., K] @ dequant(W).T (+ bias), W in compressed-tensors pack-quantized layout
(see `quantkit.format.packing`), read as stored: no repack, so the bytes a call reads are exactly
the checkpoint's `weight_packed` + `weight_scale` (+ `weight_zero_point`).

- M <= `GEMV_MAX_M[variant]`: `qk_w4a16_gemv` (see `csrc/w4a16.c`) streams the packed rows
  once per 4 activation rows, fp32 accumulation, OpenMP over output rows with torch's threads.
- larger M: `qk_w4_dequant` writes fp32 row chunks of W and MKL multiplies them (fp32 MKL is
  the fastest prefill on CPUs without bf16 instructions, see ARCHITECTURE.md); with bf16 activations
  on CPUs with bf16 matmul instructions the chunks are rounded to bf16 and oneDNN multiplies.

The kernel is built once per machine by `build` (needs gcc). The reference of the same
function is `reference.w4a16.w4a16_linear_reference`; tests hold this launcher to it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from quantkit.format.packing import INT4_MIN, unpack_zero_points
from quantkit.fused_kernels.checks import check_int4_operands
from quantkit.fused_kernels.cpu import launch as cpu_launch
from quantkit.fused_kernels.cpu.abi import W4Layer
from quantkit.fused_kernels.cpu.build import DTYPE_CODES, cpu_flags, cpu_variant
from quantkit.fused_kernels.cpu.launch import check_status, require_cpu, rows_stride
from quantkit.fused_kernels.packed_weights import PackedInt4

# Largest M that takes the GEMV; above it fp32 MKL on dequantized chunks wins. Crossovers
# measured at 4096x4096 g128 on one Zen 5 core (CPU time, GEMV vs dequant+MKL): avx512 M=512
# 143 vs 167 ms and M=1024 348 vs 345 ms (MKL runs its AVX2 code on AMD); avx2 M=64 25.3 vs
# 25.7 ms, M=128 49.5 vs 45.8 ms; generic C M=8 26.1 vs 26.8 ms.
GEMV_MAX_M = {"avx512": 1024, "avx2": 64, "generic": 8}
# With bf16 activations on a CPU with native bf16 matmuls the prefill path rounds the
# dequantized weights to bf16 (as the dense bf16 model does) and lets oneDNN multiply: faster
# from M = 32 on (576x576, one Zen 5 core: M=16 0.096 vs 0.128 ms, M=32 0.186 vs 0.144 ms).
GEMV_MAX_M_BF16 = 16
# fp32 rows dequantized per MKL call in the prefill path: 8 MB chunks stay in L2/L3 while MKL
# reads them, and bound the temporary memory for 14336x4096 layers.
_PREFILL_CHUNK_BYTES = 8 << 20


@functools.cache
def _variant(variant: str | None) -> str:
    return variant or cpu_variant()


# The compiled kernels for a variant: _library(variant=None). One library: the decode step
# (`decode`, csrc/decode.c) calls the GEMV's static functions; its functions are typed from
# `abi` (csrc/quantkit_kernels.h).
_library = cpu_launch.library_loader("qk_w4a16_cpu")


def cpu_kernel_available() -> bool:
    """True if the C kernel builds and loads here (builds it on first call)."""
    return cpu_launch.loads(_library)


def _dequant_rows(
    lib: ctypes.CDLL,
    wp: torch.Tensor,
    scale: torch.Tensor,
    zp: torch.Tensor | None,
    n0: int,
    n1: int,
    k: int,
    threads: int,
) -> torch.Tensor:
    out = torch.empty(n1 - n0, k, dtype=torch.float32)
    status = lib.qk_w4_dequant(
        wp.data_ptr(), n0, n1, k, wp.stride(0),
        scale.data_ptr(), DTYPE_CODES[scale.dtype], scale.shape[1], scale.stride(0),
        None if zp is None else zp.data_ptr(), 0 if zp is None else zp.stride(0),
        out.data_ptr(), threads,
    )  # fmt: skip
    check_status(status, "qk_w4_dequant")
    return out


def dequantize_cpu(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    in_features: int,
) -> torch.Tensor:
    """dequant(W) as fp32 [N, K] with the C kernel (bit-identical to the reference's)."""
    wp, scale = weight_packed.contiguous(), weight_scale.contiguous()
    zp = None if weight_zero_point is None else weight_zero_point.contiguous()
    threads = torch.get_num_threads()
    return _dequant_rows(_library(), wp, scale, zp, 0, wp.shape[0], in_features, threads)


def w4a16_linear_cpu(
    x: torch.Tensor,
    weights: PackedInt4,
    *,
    bias: torch.Tensor | None = None,
    check: bool = True,
    variant: str | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T (+ bias), fp32 accumulation, in x.dtype.

    `weights.group_size` is resolved (in_features for per channel). `check=False` skips the
    operand checks for callers that ran them once already (`PreparedLinear`). `variant` picks the
    instruction set (`cpu_build.supported_variants()`; default the best), for tests and benches.
    """
    if check:
        check_int4_operands(x, weights, bias=bias, backend="cpu")
        require_cpu(x)
    weight_packed, weight_scale, weight_zero_point = weights.tensors
    in_features, group_size = weights.in_features, weights.group_size
    lib = _library(variant)
    gemv_max_m = GEMV_MAX_M[_variant(variant)]
    if x.dtype == torch.bfloat16 and has_bf16_matmul():
        gemv_max_m = min(gemv_max_m, GEMV_MAX_M_BF16)
    k, n = in_features, weight_packed.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    # The kernel indexes with row strides only; these are no-ops for the usual contiguous case.
    wp, scale = rows_stride(weight_packed), rows_stride(weight_scale)
    zp = None if weight_zero_point is None else rows_stride(weight_zero_point)
    threads = torch.get_num_threads()
    if m == 0:
        return x.new_empty(*lead, n)
    if m <= gemv_max_m:
        x2 = rows_stride(x2)
        b = None if bias is None else bias.contiguous()
        out = torch.empty(m, n, dtype=x.dtype)
        status = lib.qk_w4a16_gemv(
            x2.data_ptr(), DTYPE_CODES[x.dtype], m, k, x2.stride(0),
            wp.data_ptr(), n, wp.stride(0),
            scale.data_ptr(), DTYPE_CODES[scale.dtype], scale.shape[1], scale.stride(0),
            None if zp is None else zp.data_ptr(), 0 if zp is None else zp.stride(0), group_size,
            None if b is None else b.data_ptr(), 0 if b is None else DTYPE_CODES[b.dtype],
            out.data_ptr(), DTYPE_CODES[x.dtype], n, threads,
        )  # fmt: skip
        check_status(status, "qk_w4a16_gemv")
        return out.reshape(*lead, n)
    # Prefill: rows of W in chunks, each multiplied while it is still in cache.
    bf16 = x.dtype == torch.bfloat16 and has_bf16_matmul()
    xm = x2 if bf16 else x2.float()
    out = torch.empty(m, n, dtype=xm.dtype)
    rows = max(8, _PREFILL_CHUNK_BYTES // (4 * k))
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = _dequant_rows(lib, wp, scale, zp, n0, n1, k, threads)
        torch.matmul(xm, (w.to(torch.bfloat16) if bf16 else w).T, out=out[:, n0:n1])
    if bias is not None:
        out = out.float() + bias.float()
    return out.to(x.dtype).reshape(*lead, n)


@functools.cache
def has_bf16_matmul() -> bool:
    """True if the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where oneDNN's bf16 matmul
    beats fp32 MKL: SmolLM2 576x576 at M=512 on one Zen 5 core took 0.87 ms with dequantize ->
    bf16 -> matmul against 3.1 ms for the GEMV and 3.4 ms for fp32 MKL. Without these
    instructions bf16 matmuls are emulated and ~7x slower than fp32 (ARCHITECTURE.md)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


# The GEMVs' activation dtypes and their act_dt codes (csrc/common.h: DT_I8 = 3 names int8
# activations, which only the INT4 GEMV takes), for `CpuInt4Layer` and the decode step.
ACT_CODES = {torch.float32: DTYPE_CODES[torch.float32], torch.bfloat16: DTYPE_CODES[torch.bfloat16],
             torch.int8: 3}  # fmt: skip


class CpuInt4Layer(cpu_launch.BoundGemvLayer):
    """One INT4 linear bound to the C GEMV once; a call passes only x and the output.

    Decode at SmolLM2 sizes is dominated by per-call overhead (the 576x576 GEMV itself takes
    ~10 us), so the checks, contiguity fixes, dtype codes and the 13 static kernel arguments
    are settled here, at load time. Holds references to the tensors it was built from (their
    memory stays valid); build a new one if the layer's tensors are replaced.
    """

    gemv = "qk_w4a16_gemv"

    def __init__(
        self,
        weights: PackedInt4,
        *,
        bias: torch.Tensor | None = None,
        variant: str | None = None,
    ) -> None:
        weight_packed, weight_scale, weight_zero_point = weights.tensors
        in_features, group_size = weights.in_features, weights.group_size
        require_cpu(weight_packed)
        wp, scale = weight_packed.contiguous(), weight_scale.contiguous()
        zp = None if weight_zero_point is None else weight_zero_point.contiguous()
        b = None if bias is None else bias.contiguous()
        self.bias = b
        self.in_features, self.out_features = in_features, wp.shape[0]
        self.group_size = group_size
        self._wp, self._scale = wp, scale
        self._rows16: tuple[torch.Tensor, ...] | None = None  # `interleave`
        max_m = GEMV_MAX_M[_variant(variant)]
        # the zero points one byte each as well (`qk_w4_layer.zq`): 1 byte a row and group
        self._zq = None
        if zp is not None:  # 8 + zero point, as stored
            nibbles = unpack_zero_points(zp, wp.shape[0])[:, : scale.shape[1]] - INT4_MIN
            self._zq = nibbles.to(torch.uint8).contiguous()
        layer = W4Layer(
            wp.data_ptr(), wp.shape[0], in_features, wp.stride(0),
            scale.data_ptr(), DTYPE_CODES[scale.dtype], scale.shape[1], scale.stride(0),
            None if zp is None else zp.data_ptr(), 0 if zp is None else zp.stride(0), group_size,
            None if b is None else b.data_ptr(), 0 if b is None else DTYPE_CODES[b.dtype],
            None if self._zq is None else self._zq.data_ptr(),
        )  # fmt: skip
        self._bind(
            w4a16_linear_cpu, (PackedInt4(wp, scale, zp, in_features, group_size),),
            dict(bias=b), variant=variant,
            layer=layer, fn=_library(variant).qk_w4a16_gemv_layer, max_m=max_m,
            max_m_bf16=min(max_m, GEMV_MAX_M_BF16) if has_bf16_matmul() else max_m,
        )  # fmt: skip
        if group_size != in_features and group_size % 32:
            raise ValueError(
                f"group_size: expected a multiple of 32 or per-channel, got {group_size}"
            )

    def interleave(self) -> bool:
        """Bind the int8 tile's copy of the layer (`qk_w4_layer.wr`: the packed words of 16
        rows interleaved, word j of row 16 t + l at [t, j, l]; the scales and zero-point bytes
        likewise), made on the first use of int8 activations since it holds the weights a
        second time. False where the int8 tile does not apply (no AVX512-VNNI build, or groups
        not a multiple of 32 elements); those calls run on fp32 activations."""
        if self._rows16 is not None:
            return True
        n_groups = self._scale.shape[1]
        if not (
            _library(self.variant).qk_has_int8_dot()
            and cpu_launch.int8_block(
                self.in_features if n_groups == 1 else self.group_size, self.in_features
            )
            and self._wp.shape[1] == self.in_features // 8
        ):
            return False
        wr = cpu_launch.interleave16(self._wp)
        sr = cpu_launch.interleave16(self._scale[:, :n_groups])
        zr = None if self._zq is None else cpu_launch.interleave16(self._zq)
        self._rows16 = (wr, sr) if zr is None else (wr, sr, zr)
        self._layer.wr, self._layer.sr = wr.data_ptr(), sr.data_ptr()
        self._layer.zr = None if zr is None else zr.data_ptr()
        return True

    def __call__(
        self, x: torch.Tensor, *, bf16_activations: bool = False, int8_activations: bool = False
    ) -> torch.Tensor:
        """x [..., K] @ dequant(W).T. bf16_activations: the GEMV rounds x (and the dequantized
        weights) to bf16 and sums the products in fp32, as the decode step's bf16 mode does
        (where the build has AVX512-BF16 and the groups are powers of two; else fp32).
        int8_activations: x is quantized to int8 per block of 32-128 elements inside a group
        and multiplied by the 4-bit weights in integers (`gemv_tile_i8`, on the `interleave`d
        copy; where the build has AVX512-VNNI and the groups are multiples of 32 elements;
        else fp32). A call too big for the GEMV ignores both."""
        if int8_activations:
            self.interleave()
        act = torch.bfloat16 if bf16_activations else torch.float32
        return self._gemv(x, ACT_CODES[torch.int8 if int8_activations else act])
