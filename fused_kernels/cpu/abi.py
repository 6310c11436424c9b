"""The C ABI of the CPU kernels in ctypes: `csrc/quantkit_kernels.h`, declaration by declaration.

Each exported function is listed with its return type and its parameters by name, in the C order,
and each struct the functions take by pointer has its `ctypes.Structure` mirror, field by field.
ctypes cannot read a header, and an argument declared one type too narrow (an int64_t passed as
an int, say) is silent memory corruption, so tests/test_kernels_c_abi.py parses the header and
holds this module to it: the same functions, and for each the same parameter names and types one
by one; the same struct fields in the same order.

Types: `int` is c_int, `int64_t` c_int64, `double` c_double; a pointer to one of the structs below
is POINTER(that struct) (pass the instance, or for an array of them the ctypes array); any other
pointer is c_void_p (pass a tensor's `data_ptr()`, or None for NULL).
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_double, c_int, c_int64, c_void_p
from typing import NamedTuple

from quantkit.fused_kernels.cpu.build import load_kernels

# ---------------------------------------------------------------------------------------- structs


class W4Layer(Structure):
    """`qk_w4_layer`: one INT4 layer's static arguments, bound once (`CpuInt4Layer`)."""

    _fields_ = [
        ("wq", c_void_p),
        ("N", c_int64),
        ("K", c_int64),
        ("wq_stride", c_int64),
        ("scale", c_void_p),
        ("s_dt", c_int64),
        ("n_groups", c_int64),
        ("s_stride", c_int64),
        ("zp", c_void_p),
        ("zp_stride", c_int64),
        ("group_size", c_int64),
        ("bias", c_void_p),
        ("b_dt", c_int64),
        ("zq", c_void_p),
        ("wr", c_void_p),
        ("sr", c_void_p),
        ("zr", c_void_p),
    ]


class DecoderLayer(Structure):
    """`qk_decoder_layer`: one decoder layer of the decode step (`CpuDecodeStep`)."""

    _fields_ = [
        ("qkv", W4Layer),
        ("o", W4Layer),
        ("gate_up", W4Layer),
        ("down", W4Layer),
        ("in_norm", c_void_p),
        ("post_norm", c_void_p),
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
        ("q_norm", c_void_p),
        ("k_norm", c_void_p),
        ("attn_out_norm", c_void_p),
        ("ffn_out_norm", c_void_p),
        ("sliding", c_int64),
        ("rope", c_int64),
        ("router", c_void_p),
        ("experts", POINTER(W4Layer)),
    ]


class DecoderDims(Structure):
    """`qk_decoder_dims`: the model's sizes and the KV cache's."""

    _fields_ = [
        ("hidden", c_int64),
        ("heads", c_int64),
        ("kv_heads", c_int64),
        ("head_dim", c_int64),
        ("inter", c_int64),
        ("slots", c_int64),
        ("cache_rows", c_int64),
        ("kv_dt", c_int64),
        ("eps", c_double),
        ("window", c_int64),
        ("ropes", c_int64),
        ("act", c_int64),
        ("attn_scale", c_double),
        ("attn_softcap", c_double),
        ("experts", c_int64),
        ("top_k", c_int64),
        ("renormalize", c_int64),
        ("expert_inter", c_int64),
    ]


class Fp8Layer(Structure):
    """`qk_fp8_layer`: one FP8 layer's static arguments, bound once (`CpuFp8Layer`)."""

    _fields_ = [
        ("w", c_void_p),
        ("N", c_int64),
        ("K", c_int64),
        ("w_stride", c_int64),
        ("scale", c_void_p),
        ("s_dt", c_int64),
        ("s_stride", c_int64),
        ("bias", c_void_p),
        ("b_dt", c_int64),
        ("act_quant", c_int64),
    ]


# The C name of each struct.
STRUCTS: dict[str, type[Structure]] = {
    "qk_w4_layer": W4Layer,
    "qk_decoder_layer": DecoderLayer,
    "qk_decoder_dims": DecoderDims,
    "qk_fp8_layer": Fp8Layer,
}

# -------------------------------------------------------------------------------------- functions


class Fn(NamedTuple):
    """One C function: its return type and its (name, type) parameters in order."""

    restype: type | None
    params: tuple[tuple[str, type], ...]

    @property
    def argtypes(self) -> list[type]:
        return [t for _, t in self.params]


def fn(restype: type | None, **params: type) -> Fn:
    """`fn(c_int, x=c_void_p, M=c_int64)` for `int f(const void *x, int64_t M)`."""
    return Fn(restype, tuple(params.items()))


FUNCTIONS: dict[str, Fn] = {
    # w4a16.c
    "qk_has_bf16_dot": fn(c_int),
    "qk_has_int8_dot": fn(c_int),
    "qk_w4a16_gemv_layer": fn(
        c_int,
        L=POINTER(W4Layer),
        x=c_void_p,
        x_dt=c_int,
        M=c_int64,
        x_stride=c_int64,
        out=c_void_p,
        o_dt=c_int,
        o_stride=c_int64,
        act_dt=c_int,
        n_threads=c_int,
    ),
    "qk_w4a16_gemv": fn(
        c_int,
        x=c_void_p,
        x_dt=c_int,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        wq=c_void_p,
        N=c_int64,
        wq_stride=c_int64,
        scale=c_void_p,
        s_dt=c_int,
        n_groups=c_int64,
        s_stride=c_int64,
        zp=c_void_p,
        zp_stride=c_int64,
        group_size=c_int64,
        bias=c_void_p,
        b_dt=c_int,
        out=c_void_p,
        o_dt=c_int,
        o_stride=c_int64,
        n_threads=c_int,
    ),
    "qk_w4_dequant": fn(
        c_int,
        wq=c_void_p,
        n0=c_int64,
        n1=c_int64,
        K=c_int64,
        wq_stride=c_int64,
        scale=c_void_p,
        s_dt=c_int,
        n_groups=c_int64,
        s_stride=c_int64,
        zp=c_void_p,
        zp_stride=c_int64,
        out=c_void_p,
        n_threads=c_int,
    ),
    # decode.c
    "qk_decode_phases": fn(c_int, on=c_int, out=c_void_p),
    "qk_decode_work": fn(
        c_int64,
        layers=POINTER(DecoderLayer),
        n_layers=c_int64,
        d=POINTER(DecoderDims),
        R=c_int64,
        n_threads=c_int,
    ),
    "qk_decode_step": fn(
        c_int,
        layers=POINTER(DecoderLayer),
        n_layers=c_int64,
        d=POINTER(DecoderDims),
        x=c_void_p,
        R=c_int64,
        slot=c_void_p,
        pos=c_void_p,
        cos_=c_void_p,
        sin_=c_void_p,
        act_dt=c_int,
        row_invariant=c_int,
        out_rows=c_int64,
        work=c_void_p,
        work_floats=c_int64,
        n_threads=c_int,
    ),
    # fp8.c
    "qk_fp8_gemv": fn(
        c_int,
        x=c_void_p,
        x_dt=c_int,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        act_quant=c_int,
        w=c_void_p,
        N=c_int64,
        w_stride=c_int64,
        scale=c_void_p,
        s_dt=c_int,
        s_stride=c_int64,
        bias=c_void_p,
        b_dt=c_int,
        out=c_void_p,
        o_dt=c_int,
        o_stride=c_int64,
        n_threads=c_int,
    ),
    "qk_fp8_gemv_layer": fn(
        c_int,
        L=POINTER(Fp8Layer),
        x=c_void_p,
        x_dt=c_int,
        M=c_int64,
        x_stride=c_int64,
        out=c_void_p,
        o_dt=c_int,
        o_stride=c_int64,
        n_threads=c_int,
    ),
    "qk_fp8_dequant": fn(
        c_int,
        w=c_void_p,
        n0=c_int64,
        n1=c_int64,
        K=c_int64,
        w_stride=c_int64,
        scale=c_void_p,
        s_dt=c_int,
        s_stride=c_int64,
        out=c_void_p,
        n_threads=c_int,
    ),
    "qk_fp8_quant_tokens": fn(
        c_int,
        x=c_void_p,
        x_dt=c_int,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        codes=c_void_p,
        scales=c_void_p,
    ),
    "qk_fp8_nan_rows": fn(
        c_int64,
        w=c_void_p,
        N=c_int64,
        K=c_int64,
        w_stride=c_int64,
        flags=c_void_p,
    ),
    # bf16_gemv.c
    "qk_bf16_gemv_available": fn(c_int),
    "qk_bf16_gemv": fn(
        c_int,
        x=c_void_p,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        w=c_void_p,
        N=c_int64,
        w_stride=c_int64,
        y=c_void_p,
        y_stride=c_int64,
        n_threads=c_int,
    ),
    "qk_i8_gemv_available": fn(c_int),
    "qk_i8_gemv": fn(
        c_int,
        x=c_void_p,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        w=c_void_p,
        scale=c_void_p,
        N=c_int64,
        w_stride=c_int64,
        y=c_void_p,
        y_stride=c_int64,
        n_threads=c_int,
    ),
    "qk_i8i8_gemv_available": fn(c_int),
    "qk_i8i8_gemv": fn(
        c_int,
        x=c_void_p,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        wr=c_void_p,
        scale=c_void_p,
        N=c_int64,
        block=c_int64,
        y=c_void_p,
        y_stride=c_int64,
        n_threads=c_int,
        best=c_void_p,
    ),
    # i6_gemv.c
    "qk_i6i8_gemv_available": fn(c_int),
    "qk_i6i8_gemv": fn(
        c_int,
        x=c_void_p,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        w=c_void_p,
        scale=c_void_p,
        N=c_int64,
        y=c_void_p,
        y_stride=c_int64,
        n_threads=c_int,
        best=c_void_p,
    ),
    # int8.c
    "qk_w8a8_available": fn(c_int),
    "qk_int8_peak_ops": fn(c_int64, rounds=c_int64, n_threads=c_int),
    "qk_w8a8_quant_tokens": fn(
        c_int,
        x=c_void_p,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        codes=c_void_p,
        Kp=c_int64,
        scales=c_void_p,
        sums=c_void_p,
        n_threads=c_int,
    ),
    "qk_w8a8_gemm": fn(
        c_int,
        x=c_void_p,
        M=c_int64,
        K=c_int64,
        x_stride=c_int64,
        wr=c_void_p,
        Kp=c_int64,
        scale=c_void_p,
        bias=c_void_p,
        N=c_int64,
        y=c_void_p,
        y_stride=c_int64,
        n_threads=c_int,
    ),
    # logit_mask.c
    "qk_mask_logits": fn(
        c_int,
        logits=c_void_p,
        in_stride=c_int64,
        out=c_void_p,
        out_stride=c_int64,
        bits=c_void_p,
        words=c_int64,
        rows=c_int64,
        vocab=c_int64,
    ),
}

# --------------------------------------------------------------------------------------- libraries


# The best tokens a head GEMV keeps per row (`best` [M][QK_TOP]; csrc/common.h's QK_TOP).
QK_TOP = 8


class Library(NamedTuple):
    """A library: the csrc file that is its translation unit, and the functions it exports."""

    entry: str
    functions: tuple[str, ...]


LIBRARIES: dict[str, Library] = {
    # One library for the GEMV and the decode step: decode.c includes w4a16.c, whose static
    # functions the step calls.
    "qk_w4a16_cpu": Library(
        "decode.c",
        (
            "qk_has_bf16_dot",
            "qk_has_int8_dot",
            "qk_w4a16_gemv_layer",
            "qk_w4a16_gemv",
            "qk_w4_dequant",
            "qk_decode_phases",
            "qk_decode_work",
            "qk_decode_step",
        ),
    ),
    "qk_fp8_cpu": Library(
        "fp8.c",
        (
            "qk_fp8_gemv",
            "qk_fp8_gemv_layer",
            "qk_fp8_dequant",
            "qk_fp8_quant_tokens",
            "qk_fp8_nan_rows",
        ),
    ),
    "qk_bf16_gemv": Library(
        "bf16_gemv.c",
        (
            "qk_bf16_gemv_available",
            "qk_bf16_gemv",
            "qk_i8_gemv_available",
            "qk_i8_gemv",
            "qk_i8i8_gemv_available",
            "qk_i8i8_gemv",
        ),  # fmt: skip
    ),
    "qk_i6_gemv": Library("i6_gemv.c", ("qk_i6i8_gemv_available", "qk_i6i8_gemv")),
    "qk_int8_cpu": Library(
        "int8.c", ("qk_w8a8_available", "qk_w8a8_quant_tokens", "qk_w8a8_gemm", "qk_int8_peak_ops")
    ),
    "qk_logit_mask": Library("logit_mask.c", ("qk_mask_logits",)),
}


def load(name: str, *, variant: str | None = None) -> ctypes.CDLL:
    """Build (if needed) and dlopen library `name` of `LIBRARIES` for `variant` (default: the
    best this CPU runs), with every function it exports typed from `FUNCTIONS`."""
    lib = load_kernels(name, LIBRARIES[name].entry, variant=variant)
    for fname in LIBRARIES[name].functions:
        f, spec = getattr(lib, fname), FUNCTIONS[fname]
        f.restype, f.argtypes = spec.restype, spec.argtypes
    return lib
