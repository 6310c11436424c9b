"""The CPU decode step (`decode_cpu_source`): all decoder layers for one token, one C call.

`CpuDecodeStep` binds a model's layers once (weights through their `CpuInt4Layer`s, norms and
this generation's KV cache); calling it runs every layer on the residual stream x [H] in place.
It covers batch 1, one new token, fp32 activations and INT4 q/k/v (fused), o, gate/up (fused)
and down projections; the caller keeps the PyTorch path for everything else.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantkit.fused_kernels.w4a16_cpu import CpuInt4Layer, _check_status, _Layer, _library

__all__ = ["CpuDecodeStep", "DecoderLayerParts", "DecoderDims"]


class _DecoderLayer(ctypes.Structure):
    """Mirror of the C struct `qk_decoder_layer`."""

    _fields_ = [
        ("qkv", _Layer), ("o", _Layer), ("gate_up", _Layer), ("down", _Layer),
        ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
    ]  # fmt: skip


class _Dims(ctypes.Structure):
    """Mirror of the C struct `qk_decoder_dims`."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter")],
        ("slots", ctypes.c_int64),
        ("eps", ctypes.c_double),
    ]


@dataclass(frozen=True)
class DecoderDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float


@dataclass(frozen=True)
class DecoderLayerParts:
    """One layer's operands: INT4 layers bound to the C kernel, fp32 norm weights [H], and the
    layer's KV cache tensors [1, Hkv, slots, D] (fp32, contiguous)."""

    qkv: CpuInt4Layer
    o: CpuInt4Layer
    gate_up: CpuInt4Layer
    down: CpuInt4Layer
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _expect(what: str, got: object, want: object) -> None:
    if got != want:
        raise ValueError(f"{what}: expected {want}, got {got}")


def _check_layer(i: int, p: DecoderLayerParts, d: DecoderDims) -> None:
    qkv_n = (d.heads + 2 * d.kv_heads) * d.head_dim
    for name, layer, n, k in (
        ("qkv", p.qkv, qkv_n, d.hidden),
        ("o", p.o, d.hidden, d.heads * d.head_dim),
        ("gate_up", p.gate_up, 2 * d.inter, d.hidden),
        ("down", p.down, d.hidden, d.inter),
    ):
        _expect(f"layer {i} {name} [N, K]", (layer.out_features, layer.in_features), (n, k))
        if layer.variant is not None:
            raise ValueError(f"layer {i} {name}: expected the default kernel variant")
    for name, t in (("in_norm", p.in_norm), ("post_norm", p.post_norm)):
        _expect(f"layer {i} {name}", (t.dtype, tuple(t.shape)), (torch.float32, (d.hidden,)))
    slots = p.k_cache.shape[2] if p.k_cache.dim() == 4 else -1
    for name, t in (("k_cache", p.k_cache), ("v_cache", p.v_cache)):
        _expect(
            f"layer {i} {name}",
            (t.dtype, tuple(t.shape), t.is_contiguous()),
            (torch.float32, (1, d.kv_heads, slots, d.head_dim), True),
        )


class CpuDecodeStep:
    """Every layer of one model for one token at a time; see the module docstring."""

    def __init__(self, layers: Sequence[DecoderLayerParts], dims: DecoderDims) -> None:
        if not layers:
            raise ValueError("layers: expected at least one decoder layer, got none")
        if dims.heads % dims.kv_heads:
            raise ValueError(
                f"heads: expected a multiple of kv_heads {dims.kv_heads}, got {dims.heads}"
            )
        for i, p in enumerate(layers):
            _check_layer(i, p, dims)
        self.slots = layers[0].k_cache.shape[2]
        self._keep = list(layers)  # the tensors behind the pointers stay alive
        self._layers = (_DecoderLayer * len(layers))()
        for dst, p in zip(self._layers, layers, strict=True):
            dst.qkv, dst.o, dst.gate_up, dst.down = (
                p.qkv._layer, p.o._layer, p.gate_up._layer, p.down._layer,
            )  # fmt: skip
            dst.in_norm, dst.post_norm = p.in_norm.data_ptr(), p.post_norm.data_ptr()
            dst.k_cache, dst.v_cache = p.k_cache.data_ptr(), p.v_cache.data_ptr()
        self._dims = _Dims(
            dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.inter, self.slots,
            dims.eps,
        )  # fmt: skip
        self.hidden, self.head_dim = dims.hidden, dims.head_dim
        lib = _library()
        lib.qk_decode_work.restype = ctypes.c_int64
        lib.qk_decode_work.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.qk_decode_step.restype = ctypes.c_int
        lib.qk_decode_step.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
        ]  # fmt: skip
        self._fn = lib.qk_decode_step
        n = lib.qk_decode_work(
            ctypes.addressof(self._layers), len(layers), ctypes.addressof(self._dims)
        )
        self._work = torch.empty(int(n), dtype=torch.float32)
        self._args = (ctypes.addressof(self._layers), len(layers), ctypes.addressof(self._dims))

    def __call__(
        self, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Run every layer on x (fp32, H contiguous values), updated in place and returned;
        the token sits at cache slot `position`; cos/sin: its D rotary values each."""
        for name, t, n in (("x", x, self.hidden), ("cos", cos, self.head_dim), ("sin", sin, None)):
            want = n or self.head_dim
            if t.dtype != torch.float32 or t.numel() != want or not t.is_contiguous():
                raise ValueError(
                    f"{name}: expected {want} contiguous float32 values, got {t.dtype} "
                    f"{tuple(t.shape)}"
                )
        if not 0 <= position < self.slots:
            raise ValueError(f"position: expected 0 to {self.slots - 1}, got {position}")
        status = self._fn(
            *self._args, x.data_ptr(), position, cos.data_ptr(), sin.data_ptr(),
            self._work.data_ptr(), self._work.numel(), torch.get_num_threads(),
        )  # fmt: skip
        _check_status(status, "qk_decode_step")
        return x
