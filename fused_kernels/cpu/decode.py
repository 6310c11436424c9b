"""The CPU decode step (`csrc/decode.c`): all decoder layers for one new token of each of
R sequences, one C call.

`CpuDecodeStep` binds a model's layers once (weights through their `CpuInt4Layer`s, norms and
a KV cache of any number of rows); calling it runs every layer on the residual streams x [R, H]
in place, row r at cache row `slots[r]` and position `positions[r]`: one new token of each of R
sequences (a batched decode step), or R consecutive tokens of one sequence (a causal prefill:
every row writes its K/V before any row attends). It covers fp32 activations and INT4 q/k/v
(fused), o, gate/up (fused) and down projections; the caller keeps the PyTorch path for
everything else. Beyond a Llama layer it has what the dense families add: per-head q/k RMSNorm
(Qwen3, Gemma 3), norms of the sublayers' outputs (Gemma), sliding-window layers, several rope
tables (Gemma 3's local rope), a GELU gate, a q k^T scale other than 1/sqrt(D) and soft-capped
attention logits (Gemma 2).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.cpu.abi import DecoderDims as _Dims
from quantkit.fused_kernels.cpu.abi import DecoderLayer as _DecoderLayer
from quantkit.fused_kernels.cpu.abi import W4Layer as _W4Layer
from quantkit.fused_kernels.cpu.launch import check_status
from quantkit.fused_kernels.cpu.w4a16 import ACT_CODES, CpuInt4Layer, _library

__all__ = [
    "ACTIVATION_CODES",
    "CACHE_FORMATS",
    "PHASES",
    "CpuDecodeStep",
    "DecoderDims",
    "DecoderLayerParts",
    "ACT_CODES",
    "bf16_activations_available",
    "decode_phases",
    "int8_activations_available",
]

# The phases of a layer that `speed.decode_phases` times (csrc/decode.c, enum PH_*, in its order):
# "norm" holds the RMSNorms and residual adds, "permute" the activations' rearrangement (and
# bf16 rounding) before each GEMV, "rope_kv" the rotary embedding and the K/V cache write.
# "route" is a MoE layer's router, top-k and gathering of each expert's rows (the experts'
# GEMVs count as gate_up and down).
PHASES = (
    "norm", "permute", "qkv", "rope_kv", "attention", "o", "gate_up", "silu", "down", "route",
)  # fmt: skip


def bf16_activations_available() -> bool:
    """True if the kernels build here with the bf16 tile (the CPU has AVX512-BF16), so that
    the GEMVs can take bf16 activations (`gemv_tile2_bf16` in csrc/w4a16.c)."""
    try:
        return bool(_library().qk_has_bf16_dot())
    except KernelUnavailableError:
        return False


def int8_activations_available() -> bool:
    """True if the kernels build here with the int8 tile (the CPU has AVX512-VNNI), so that
    the GEMVs can take int8 activations (`gemv_tile_i8` in csrc/w4a16.c)."""
    try:
        return bool(_library().qk_has_int8_dot())
    except KernelUnavailableError:
        return False


def decode_phases(on: bool) -> tuple[dict[str, float], int]:
    """({phase: seconds}, steps) that the decode steps spent in each phase since the last call,
    summed over layers (zeroed by this call); `on` turns the timers on (or off) from now.
    One thread reads the clock at each phase's end, so a phase includes its barrier wait."""
    out = (ctypes.c_double * len(PHASES))()
    steps = int(_library().qk_decode_phases(int(on), ctypes.addressof(out)))
    return dict(zip(PHASES, list(out), strict=True)), steps


# The MLP gate activations the step computes, by `models.layers.ACTIVATIONS` name: its code.
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}


@dataclass(frozen=True)
class DecoderDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    window: int | None = None  # the sliding layers' window
    ropes: int = 1  # rotary tables: cos/sin hold `ropes` rows of head_dim per token
    activation: str = "silu"  # one of ACTIVATION_CODES
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2's cap on the attention logits
    # The MoE layers': experts, experts a token runs, their weights renormalised to sum 1,
    # an expert's intermediate size (0 without MoE).
    experts: int = 0
    top_k: int = 0
    renormalize: bool = False
    expert_inter: int = 0


@dataclass(frozen=True)
class DecoderLayerParts:
    """One layer's operands: INT4 layers bound to the C kernel, fp32 norm weights [H], and the
    layer's KV cache tensors [rows, Hkv, slots, E], contiguous, in one of the formats of
    `CACHE_FORMATS` (`quantkit.models.kv_cache`)."""

    qkv: CpuInt4Layer
    o: CpuInt4Layer
    gate_up: CpuInt4Layer | None  # None in a MoE layer
    down: CpuInt4Layer | None
    in_norm: torch.Tensor  # the attention's input norm
    post_norm: torch.Tensor  # the MLP's input norm
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None  # [D] per-head norms of q and k before rope
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [H] norms of the sublayers' outputs (Gemma)
    ffn_out_norm: torch.Tensor | None = None
    sliding: bool = False  # attends to the last `DecoderDims.window` positions only
    rope: int = 0  # the rotary table it reads
    # A mixture of experts in place of gate_up / down: the router's weight [experts, H] fp32,
    # and each expert's (gate, up, down).
    router: torch.Tensor | None = None
    experts: tuple[tuple[CpuInt4Layer, CpuInt4Layer, CpuInt4Layer], ...] | None = None


# The cache formats the step reads, by the cache tensors' dtype: (its `kv_dt` code, E - D).
# fp32 and bf16 hold the values; int8 and uint8 (fp8 e4m3 codes) hold D codes and then the
# head's fp32 scale in 4 more bytes (csrc/attend.c).
CACHE_FORMATS = {
    torch.float32: (0, 0),
    torch.bfloat16: (1, 0),
    torch.int8: (2, 4),
    torch.uint8: (3, 4),
}


def _expect(what: str, got: object, want: object) -> None:
    if got != want:
        raise ValueError(f"{what}: expected {want}, got {got}")


def _matmuls(i: int, p: DecoderLayerParts, d: DecoderDims) -> list[tuple[str, object, int, int]]:
    """(name, layer, N, K) of each matmul of layer i: q/k/v, o, then gate_up and down, or each
    expert's gate, up and down."""
    qkv_n = (d.heads + 2 * d.kv_heads) * d.head_dim
    out = [("qkv", p.qkv, qkv_n, d.hidden), ("o", p.o, d.hidden, d.heads * d.head_dim)]
    if p.router is None:
        return [
            *out,
            ("gate_up", p.gate_up, 2 * d.inter, d.hidden),
            ("down", p.down, d.hidden, d.inter),
        ]
    if p.experts is None or len(p.experts) != d.experts or not 1 <= d.top_k <= d.experts:
        raise ValueError(
            f"layer {i} experts: expected {d.experts} (gate, up, down), top_k 1 to "
            f"{d.experts}, got {None if p.experts is None else len(p.experts)}, top_k {d.top_k}"
        )
    _expect(
        f"layer {i} router",
        (p.router.dtype, tuple(p.router.shape), p.router.is_contiguous()),
        (torch.float32, (d.experts, d.hidden), True),
    )
    sizes = ((d.expert_inter, d.hidden), (d.expert_inter, d.hidden), (d.hidden, d.expert_inter))
    for e, parts in enumerate(p.experts):
        for part, layer, (n, k) in zip(("gate", "up", "down"), parts, sizes, strict=True):
            out.append((f"expert {e} {part}", layer, n, k))
    return out


def _check_layer(i: int, p: DecoderLayerParts, d: DecoderDims) -> None:
    groups: dict[str, int] = {}
    for name, layer, n, k in _matmuls(i, p, d):
        if layer is None:
            raise ValueError(f"layer {i} {name}: expected an INT4 layer, got none")
        _expect(f"layer {i} {name} [N, K]", (layer.out_features, layer.in_features), (n, k))
        if layer.variant is not None:
            raise ValueError(f"layer {i} {name}: expected the default kernel variant")
        if name.startswith("expert"):  # every expert's groups are the first's (one scratch)
            role = name.rsplit(" ", 1)[1]
            _expect(
                f"layer {i} {name} group size",
                layer.group_size,
                groups.setdefault(role, layer.group_size),
            )
    norms = {
        "in_norm": (p.in_norm, d.hidden), "post_norm": (p.post_norm, d.hidden),
        "q_norm": (p.q_norm, d.head_dim), "k_norm": (p.k_norm, d.head_dim),
        "attn_out_norm": (p.attn_out_norm, d.hidden), "ffn_out_norm": (p.ffn_out_norm, d.hidden),
    }  # fmt: skip
    for name, (t, n) in norms.items():
        if t is not None:
            _expect(
                f"layer {i} {name}",
                (t.dtype, tuple(t.shape), t.is_contiguous()),
                (torch.float32, (n,), True),
            )
    if (p.q_norm is None) != (p.k_norm is None):
        raise ValueError(f"layer {i} q_norm, k_norm: expected both or neither, got one")
    if not 0 <= p.rope < d.ropes:
        raise ValueError(f"layer {i} rope: expected 0 to {d.ropes - 1}, got {p.rope}")
    if p.sliding and not d.window:
        raise ValueError(f"layer {i}: expected a window for a sliding layer, got none")
    rows, slots = p.k_cache.shape[:3:2] if p.k_cache.dim() == 4 else (-1, -1)
    if p.k_cache.dtype not in CACHE_FORMATS:
        raise ValueError(
            f"layer {i} k_cache: expected one of {', '.join(map(str, CACHE_FORMATS))}, got "
            f"{p.k_cache.dtype}"
        )
    width = d.head_dim + CACHE_FORMATS[p.k_cache.dtype][1]
    for name, t in (("k_cache", p.k_cache), ("v_cache", p.v_cache)):
        _expect(
            f"layer {i} {name}",
            (t.dtype, tuple(t.shape), t.is_contiguous()),
            (p.k_cache.dtype, (rows, d.kv_heads, slots, width), True),
        )


class CpuDecodeStep:
    """Every layer of one model for one new token per row; see the module docstring."""

    def __init__(
        self,
        layers: Sequence[DecoderLayerParts],
        dims: DecoderDims,
        *,
        act_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not layers:
            raise ValueError("layers: expected at least one decoder layer, got none")
        if dims.heads % dims.kv_heads:
            raise ValueError(
                f"heads: expected a multiple of kv_heads {dims.kv_heads}, got {dims.heads}"
            )
        if dims.activation not in ACTIVATION_CODES:
            raise ValueError(
                f"activation: expected one of {', '.join(ACTIVATION_CODES)}, got {dims.activation}"
            )
        if dims.ropes < 1 or (dims.window is not None and dims.window < 1):
            raise ValueError(f"ropes, window: expected >= 1 each, got {dims.ropes}, {dims.window}")
        for i, p in enumerate(layers):
            _check_layer(i, p, dims)
        shape, kind = tuple(layers[0].k_cache.shape), layers[0].k_cache.dtype
        for i, p in enumerate(layers):
            _expect(f"layer {i} cache", (p.k_cache.dtype, tuple(p.k_cache.shape)), (kind, shape))
        self.cache_rows, self.slots = shape[0], shape[2]
        if act_dtype == torch.int8:  # the int8 tile's interleaved copies, before the structs
            for i, p in enumerate(layers):
                for _, layer, _, _ in _matmuls(i, p, dims):
                    layer.interleave()  # type: ignore[attr-defined]
        self._keep = list(layers)  # the tensors behind the pointers stay alive
        self._layers = (_DecoderLayer * len(layers))()
        self._experts = []  # each MoE layer's W4Layer array, alive as long as the step
        for dst, p in zip(self._layers, layers, strict=True):
            dst.qkv, dst.o = p.qkv._layer, p.o._layer
            if p.gate_up is not None and p.down is not None:
                dst.gate_up, dst.down = p.gate_up._layer, p.down._layer
            if p.router is not None and p.experts is not None:
                array = (_W4Layer * (3 * len(p.experts)))(
                    *(layer._layer for parts in p.experts for layer in parts)
                )
                self._experts.append(array)
                dst.router, dst.experts = p.router.data_ptr(), array
            dst.in_norm, dst.post_norm = p.in_norm.data_ptr(), p.post_norm.data_ptr()
            dst.k_cache, dst.v_cache = p.k_cache.data_ptr(), p.v_cache.data_ptr()
            dst.q_norm, dst.k_norm, dst.attn_out_norm, dst.ffn_out_norm = (
                None if t is None else t.data_ptr()
                for t in (p.q_norm, p.k_norm, p.attn_out_norm, p.ffn_out_norm)
            )
            dst.sliding, dst.rope = int(p.sliding), p.rope
        self._dims = _Dims(
            dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.inter, self.slots,
            self.cache_rows, CACHE_FORMATS[kind][0], dims.eps, dims.window or 0, dims.ropes,
            ACTIVATION_CODES[dims.activation], dims.attn_scale or 0.0, dims.attn_softcap or 0.0,
            dims.experts, dims.top_k, int(dims.renormalize), dims.expert_inter,
        )  # fmt: skip
        self.hidden, self.head_dim, self.ropes = dims.hidden, dims.head_dim, dims.ropes
        lib = _library()  # qk_decode_work, qk_decode_step: typed by `abi`
        if act_dtype not in ACT_CODES:
            raise ValueError(
                f"act_dtype: expected torch.float32, torch.bfloat16 or torch.int8, got {act_dtype}"
            )
        if act_dtype == torch.bfloat16 and not lib.qk_has_bf16_dot():
            raise ValueError(
                "act_dtype: bfloat16 needs the AVX512-BF16 build of the kernels, got a CPU "
                "without avx512_bf16"
            )
        if act_dtype == torch.int8 and not lib.qk_has_int8_dot():
            raise ValueError(
                "act_dtype: int8 needs the AVX512-VNNI build of the kernels, got a CPU without "
                "avx512_vnni"
            )
        self.act_dtype, self._act = act_dtype, ACT_CODES[act_dtype]
        self._fn, self._work_fn = lib.qk_decode_step, lib.qk_decode_work
        self._args = (self._layers, len(layers), self._dims)  # layers, n_layers, d
        self._work = torch.empty(0, dtype=torch.float32)  # grown to the most rows seen
        self._needs: dict[tuple[int, int], int] = {}  # floats of work by (rows, threads)

    def _work_for(self, rows: int, threads: int) -> torch.Tensor:
        need = self._needs.get((rows, threads))
        if need is None:
            need = self._needs[rows, threads] = int(self._work_fn(*self._args, rows, threads))
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        return self._work

    def __call__(
        self,
        x: torch.Tensor,
        positions: Sequence[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        slots: Sequence[int] | None = None,
        row_invariant: bool = False,
        out_rows: int | None = None,
    ) -> torch.Tensor:
        """Run every layer on x [R, H] (fp32, contiguous), updated in place and returned. Row r's
        token sits at cache row `slots[r]` (default r) and position `positions[r]`, and attends
        to that cache row's positions <= its own, including those other rows of this call
        write (rows sharing a cache row: a prompt's tokens, prefilled causally); cos/sin
        [R, ropes x D]: each row's rotary values, table by table. row_invariant: each row's
        result is bit-identical to a one-row call's (the GEMVs take the rows one at a time;
        slower for many rows), which speculative decoding's verification needs to reproduce
        plain decoding exactly. out_rows: how many of the last rows' results are wanted (default
        all): the last layer writes every row's keys and values but computes the rest for those
        rows only, so the rows before them come back as the layer before the last left them (a
        prompt wants its last row's; the other rows' keys and values are what it leaves)."""
        rows = len(positions)
        if rows < 1:
            raise ValueError("positions: expected at least one row, got none")
        out_rows = rows if out_rows is None else out_rows
        if not 0 <= out_rows <= rows:
            raise ValueError(
                f"out_rows: expected 0 to {rows} (the rows of the call), got {out_rows}"
            )
        slots = range(rows) if slots is None else slots
        rope_width = self.ropes * self.head_dim
        for name, t, n in (("x", x, self.hidden), ("cos", cos, rope_width), ("sin", sin, 0)):
            want = (rows, n or rope_width)
            shape_ok = t.numel() == want[0] * want[1] and t.is_contiguous()
            if t.dtype != torch.float32 or not shape_ok:
                raise ValueError(
                    f"{name}: expected {want[0]} x {want[1]} contiguous float32 values, got "
                    f"{t.dtype} {tuple(t.shape)}"
                )
        if len(slots) != rows or len(set(zip(slots, positions, strict=True))) != rows:
            raise ValueError(
                "slots: expected one per position, no (slot, position) twice, got "
                f"{list(slots)} for positions {list(positions)}"
            )
        for what, values, bound in (("position", positions, self.slots),
                                    ("slot", slots, self.cache_rows)):  # fmt: skip
            bad = [v for v in values if not 0 <= v < bound]
            if bad:
                raise ValueError(f"{what}: expected 0 to {bound - 1}, got {bad[0]}")
        pos_t = torch.tensor(positions, dtype=torch.int64)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        threads = torch.get_num_threads()
        work = self._work_for(rows, threads)
        status = self._fn(
            *self._args, x.data_ptr(), rows, slot_t.data_ptr(), pos_t.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), self._act, int(row_invariant), out_rows,
            work.data_ptr(), work.numel(), threads,
        )  # fmt: skip
        check_status(status, "qk_decode_step")
        return x
