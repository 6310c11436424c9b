"""GPTQ (Frantar et al. 2022): error-compensated rounding, one decoder layer at a time.

Round-to-nearest minimises each weight's own error; what matters is a Linear's output error
||X W^T - X Q^T||^2 = tr((W - Q) H (W - Q)^T) with H = X^T X over the calibration inputs X of
that Linear. GPTQ rounds the columns (input channels) of W one at a time and, after each, moves
the column's rounding error onto the columns not yet rounded, weighted by the inverse Hessian, so
that they absorb it (the optimal brain surgeon update). Per Linear:

1. H = 2 X^T X / tokens (fp32 matmuls per chunk, summed in fp64); input channels that never fire
   (diag 0) get H_jj = 1 and weight 0, so they neither take nor give error.
2. Optional act-order: round the columns by diag(H) descending (the loudest inputs first, while
   the most columns remain to absorb their error).
3. Dampening: H + damp * mean(diag H) * I keeps the inverse well conditioned.
4. U = upper Cholesky factor of H^-1 (H^-1 = U^T U): row i of U restricted to columns >= i is
   the error-propagation row for column i once columns < i are fixed.
5. Columns in blocks of `block_size`: inside a block the update is applied column by column;
   the block's accumulated errors reach the columns after it in one matmul ("lazy batch").

The rounding itself is a function passed in (`RoundFn`), with its scales fixed beforehand: for
FP8 E4M3 the per-row scale is absmax / 448 as stored in the checkpoint dtype, and a column is
rounded with `fp8_codes` on that scale (INT8 likewise on absmax / 127; both: `gptq_rows`); for INT4
the group-wise scales and zero points are RTN's (min/max per group), and a column is rounded in
its group (`Int4Rounder`).

Layer by layer (`gptq_quantize`): the calibration activations enter each decoder layer from
the already-quantized layers before it. Within a layer, the Linears that share an input
(`Family.input_groups`: q/k/v, then o, then gate/up, then down) are quantized in forward order and,
with `sequential`, each group's H is captured after the earlier groups were quantized, so it sees
the errors they really make. Peak memory: the model plus one layer's activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from quantkit.format.int4 import int4_tensors
from quantkit.format.packing import (
    INT4_MAX,
    INT4_MIN,
    int4_dequantize,
    int4_qparams,
    int4_quantize,
)
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family
from quantkit.quantize.clip_search import CLIP_MODES, clip_ratios
from quantkit.quantize.gptq_fp4 import Fp4Rounder
from quantkit.quantize.gptq_rows import Fp8Rounder, Int8Rounder
from quantkit.quantize.layer_walk import (
    LayerErrorReport,
    LayerWalk,
    PhaseClock,
    finish_layer,
    first_layer_inputs,
    layer_call,
    run_walk,
)
from quantkit.quantize.moe import expert_token_counts, moe_input_groups
from quantkit.quantize.refine import refine_int4

# (columns [N, m] of the weight, their original column indices [m]) -> the dequantized values
# the checkpoint will hold for them [N, m]. The indices let a group-wise (INT4) rounding pick its
# scale even when act-order has permuted the columns.
RoundFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
FP8 = QuantScheme("fp8")


@dataclass(frozen=True)
class GptqConfig:
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # columns per lazy-batch block
    # SmolLM2-135M, FP8, 64 x 512 calibration tokens (evals/studies/gptq_quality.py; reference
    # 20.848, RTN 21.119): plain GPTQ 20.977, act-order 20.954, one capture per layer 20.954, both
    # 20.966, i.e. the same within the noise of rounding; act-order lowers the layer-output
    # error GPTQ minimises (mean reduction vs RTN 51% -> 58%), and one capture of every H per
    # layer takes 143 s instead of 182 s for re-capturing after each input group.
    act_order: bool = True  # round columns by diag(H) descending
    sequential: bool = False  # each input group's H sees the earlier groups already quantized
    batch_sequences: int = 16  # sequences per forward chunk (bounds activation memory)
    # INT4: shrink each group's min/max range by the ratio minimising its rounding error
    # (`clip_search`: none = RTN's scales, mse = the weights' error, output = the group's output
    # error under H); the codes are then GPTQ-rounded on the clipped scales.
    clip: str = "none"
    # INT4: passes of coordinate descent on the codes, then the group scales, after GPTQ
    # (`refine`), 0 = none. 4 by default: on SmolLM2-135M awq+gptq closes 68.6% of the RTN
    # perplexity gap with it, 62.5% without, for 16% more quantize time (README).
    refine: int = 4

    def __post_init__(self) -> None:
        if self.clip not in CLIP_MODES:
            raise ValueError(f"clip: expected one of {', '.join(CLIP_MODES)}, got {self.clip!r}")


class Hessian:
    """Running H = 2 X^T X / tokens for one Linear input (X [tokens, K])."""

    def __init__(self, k: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        # fp32 matmul per chunk (fp64 GEMM is several times slower on CPU), fp64 running sum.
        self.sum += (flat.T @ flat).double()
        self.tokens += flat.shape[0]

    def matrix(self) -> torch.Tensor:
        if self.tokens == 0:
            raise ValueError("Hessian: expected at least one calibration token, got none")
        return self.sum * (2.0 / self.tokens)


def _upper_inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """U (upper) with (H + damp * mean(diag H) * I)^-1 = U^T U, in fp64. A factorisation that
    fails (an H singular to working precision) is retried with 10x the damping, twice."""
    mean_diag = float(h.diagonal().mean())
    for attempt in range(3):
        damped = h.clone()
        damped.diagonal().add_(damp * 10**attempt * mean_diag)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError(
        f"Hessian: expected a positive definite matrix after damping up to {damp * 100:g}x "
        "mean(diag), got a singular one"
    )


def gptq_round(
    w: torch.Tensor,
    h: torch.Tensor,
    *,
    round_fn: RoundFn,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> torch.Tensor:
    """GPTQ-rounded W [N, K] (fp32, the dequantized values `round_fn` returned) for inputs with
    Hessian h [K, K]. Rows are independent, so Linears sharing an input can be stacked."""
    n, k = w.shape
    if h.shape != (k, k):
        raise ValueError(f"h: expected [{k}, {k}] for a weight [{n}, {k}], got {tuple(h.shape)}")
    if block_size < 1 or damp < 0:
        raise ValueError(f"expected block_size >= 1 and damp >= 0, got {block_size} and {damp}")
    w = w.detach().float().clone()
    h = h.detach().double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    index = torch.arange(k, device=w.device)
    if act_order:
        index = torch.argsort(h.diagonal(), descending=True)
        w, h = w[:, index], h[index][:, index]
    u = _upper_inverse_cholesky(h, damp).float()
    q = torch.zeros_like(w)
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        u_block = u[start:end, start:end]
        for i in range(end - start):
            column = block[:, i : i + 1]
            rounded = round_fn(column, index[start + i : start + i + 1])
            q[:, start + i : start + i + 1] = rounded
            err = (column - rounded) / u_block[i, i]
            # The columns after i in this block absorb the error now; later blocks at the end.
            block[:, i:] -= err @ u_block[i : i + 1, i:]
            errors[:, i : i + 1] = err
        w[:, end:] -= errors @ u[start:end, end:]
    if act_order:
        q = q[:, torch.argsort(index)]
    return q


def output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the summed squared output error per calibration token (x 2)."""
    d = (w.double() - q.double()).to(h.dtype)
    return float(((d @ h) * d).sum())


class Rounder(Protocol):
    """One format's rounding on scales fixed before GPTQ starts (as the checkpoint stores them)."""

    def round(self, columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The `RoundFn`: dequantized values of `columns` at original column indices `index`."""
        ...

    def nearest(self, w: torch.Tensor) -> torch.Tensor:
        """Round-to-nearest of all of W on the same scales (the baseline of the error report)."""
        ...

    def stored(self, q: torch.Tensor) -> torch.Tensor:
        """The fp32 values the checkpoint computes with for the GPTQ-rounded q."""
        ...

    def tensors(
        self, q: torch.Tensor, rows: slice, *, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (local names) of rows `rows` of the GPTQ-rounded q."""
        ...


class Int4Rounder:
    """Group-wise INT4 on RTN's scales and zero points (min/max of each group, each range shrunk
    by `clip_ratio`, a scalar or [N, K/G]), the scales as `scale_dtype` stores them. act-order
    permutes columns, so a column finds its group from its original index."""

    def __init__(
        self,
        w: torch.Tensor,
        scheme: QuantScheme,
        *,
        scale_dtype: torch.dtype,
        clip_ratio: float | torch.Tensor = 1.0,
    ) -> None:
        self.group = scheme.group_size_for(w.shape[1])
        scale, self.zero = int4_qparams(
            w, group_size=self.group, symmetric=scheme.symmetric, clip_ratio=clip_ratio
        )
        self.scale = scale.to(scale_dtype).float()

    def round(self, columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        groups = index // self.group
        s = self.scale[:, groups]
        z = 0.0 if self.zero is None else self.zero[:, groups].float()
        q = torch.round(columns / s + z).clamp(INT4_MIN, INT4_MAX)
        return (q - z) * s

    def codes(self, q: torch.Tensor) -> torch.Tensor:
        return int4_quantize(q, self.scale, self.zero, group_size=self.group)

    def nearest(self, w: torch.Tensor) -> torch.Tensor:
        codes = int4_quantize(w, self.scale, self.zero, group_size=self.group)
        return int4_dequantize(codes, self.scale, self.zero, group_size=self.group)

    def stored(self, q: torch.Tensor) -> torch.Tensor:
        return int4_dequantize(self.codes(q), self.scale, self.zero, group_size=self.group)

    def tensors(
        self, q: torch.Tensor, rows: slice, *, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        zero = None if self.zero is None else self.zero[rows]
        codes = int4_quantize(q[rows], self.scale[rows], zero, group_size=self.group)
        return int4_tensors(codes, self.scale[rows], zero, dtype=dtype)


ROUNDERS: dict[str, type[Fp8Rounder] | type[Int4Rounder] | type[Fp4Rounder] | type[Int8Rounder]] = {
    "fp8": Fp8Rounder,
    "int8": Int8Rounder,
    "int4": Int4Rounder,
    "nvfp4": Fp4Rounder,
    "mxfp4": Fp4Rounder,
}


def gptq_weight(
    w: torch.Tensor,
    h: torch.Tensor,
    *,
    scheme: QuantScheme,
    cfg: GptqConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
    clip_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Fp8Rounder | Int4Rounder]:
    """W [N, K] -> (GPTQ-rounded dequantized W [N, K] fp32, the rounder holding its scales).
    INT4 only: `clip_ratio` [N, K/G] shrinks the groups' ranges (`Int4Rounder`)."""
    cfg = cfg or GptqConfig()
    rounder: Fp8Rounder | Int4Rounder
    if clip_ratio is None:
        rounder = ROUNDERS[scheme.kind](w, scheme, scale_dtype=scale_dtype)
    elif scheme.kind == "int4":
        rounder = Int4Rounder(w, scheme, scale_dtype=scale_dtype, clip_ratio=clip_ratio)
    else:
        raise ValueError(f"clip_ratio: expected None for {scheme.kind}, got a tensor")
    q = gptq_round(
        w,
        h,
        round_fn=rounder.round,
        damp=cfg.damp,
        block_size=cfg.block_size,
        act_order=cfg.act_order,
    )
    if cfg.refine and isinstance(rounder, Int4Rounder):
        q, rounder.scale = refine_int4(
            w, q, h, scale=rounder.scale, zero=rounder.zero, group_size=rounder.group,
            passes=cfg.refine, scale_dtype=scale_dtype,
        )  # fmt: skip
    return q, rounder


def gptq_fp8(
    w: torch.Tensor,
    h: torch.Tensor,
    *,
    cfg: GptqConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (float8_e4m3fn codes [N, K], fp32 scale [N, 1]) with GPTQ rounding."""
    q, rounder = gptq_weight(w, h, scheme=FP8, cfg=cfg, scale_dtype=scale_dtype)
    return rounder.codes(q), rounder.scale


@dataclass
class GptqLayerReport(LayerErrorReport):
    """rtn_error / method_error: summed over the layer's Linears, output_error(W, Q, H) of the
    round-to-nearest and the GPTQ-rounded weights."""


def _tokens(hessians: dict[str, Hessian]) -> Callable[[str], int]:
    """Tokens a Linear's Hessian saw (0 for one never called: an expert nothing routed to)."""
    return lambda name: hessians[name].tokens if name in hessians else 0


def hessian_for(layer: nn.Module, name: str) -> Hessian:
    """An empty Hessian for Linear `name`'s input, on the device its weight is on."""
    linear = layer.get_submodule(name)
    return Hessian(linear.in_features, device=linear.weight.device)


class _StopForward(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by a capture hook once the last Linear a stage needs has seen its input: the rest
    of the layer's forward would be wasted work."""


def _capture_hessians(
    layer: nn.Module, x: torch.Tensor, run_layer: Callable, names: list[str], chunk: int
) -> dict[str, Hessian]:
    """H of the input of each Linear in `names` (the first of each input group), over x."""
    hessians = {n: hessian_for(layer, n) for n in names}
    last = names[-1]

    def hook_for(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            hessians[name].add(args[0])
            if name == last:
                raise _StopForward

        return hook

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        with torch.no_grad():
            for part in x.split(chunk):
                try:
                    run_layer(part)
                except _StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def gptq_walk(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    arch: Family | None = None,
    scheme: QuantScheme,
    cfg: GptqConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> LayerWalk:
    """GPTQ as a `LayerWalk`: each step GPTQ-rounds one decoder layer's Linears to `scheme`
    (int4 or fp8) with scales stored in `scale_dtype`, gives them their dequantized values in
    place and returns {module name: its checkpoint tensors (local names)}. `model` supplies the
    embedding, rotary tables and config. The Linears and their input groups are the family's
    (`arch`, default `model.family`)."""
    cfg = cfg or GptqConfig()
    x, cos, sin = first_layer_inputs(model, samples, batch_sequences=cfg.batch_sequences)
    plan = gptq_plan(model, arch=arch, scheme=scheme, cfg=cfg, scale_dtype=scale_dtype)

    def step(
        index: int, layer: nn.Module, x: torch.Tensor | None
    ) -> tuple[dict[str, dict[str, torch.Tensor]], GptqLayerReport, torch.Tensor]:
        assert x is not None
        report = GptqLayerReport(index)
        clock = PhaseClock(report.seconds)
        run_layer = layer_call(layer, cos, sin)
        result = round_layer(plan, index, layer, x, run_layer, report=report, clock=clock)
        # Feed the quantized layer's output onward.
        return result, report, finish_layer(run_layer, x, cfg.batch_sequences, clock=clock)

    return LayerWalk(step, x)


@dataclass(frozen=True)
class GptqPlan:
    """What every layer's rounding shares: the settings and the Linears' input groups."""

    model: CausalLM
    scheme: QuantScheme
    cfg: GptqConfig
    scale_dtype: torch.dtype
    input_groups: list[tuple[str, ...]]  # in forward order, the experts' after the family's
    no_clip: tuple[str, ...]  # Linears whose ranges `cfg.clip` leaves whole (`Family.no_clip`)

    @property
    def stages(self) -> list[list[tuple[str, ...]]]:
        """The groups whose Hessians are captured together: all at once, or with `sequential`
        one group at a time, after the earlier ones were rounded."""
        groups = self.input_groups
        return [[g] for g in groups] if self.cfg.sequential else [groups]


def gptq_plan(
    model: CausalLM,
    *,
    arch: Family | None = None,
    scheme: QuantScheme,
    cfg: GptqConfig,
    scale_dtype: torch.dtype,
) -> GptqPlan:
    arch = arch or model.family
    groups = [*arch.input_groups, *moe_input_groups(model)]
    return GptqPlan(model, scheme, cfg, scale_dtype, groups, tuple(arch.no_clip))


def round_layer(
    plan: GptqPlan,
    index: int,
    layer: nn.Module,
    x: torch.Tensor,
    run_layer: Callable,
    *,
    report: GptqLayerReport,
    clock: PhaseClock,
    given: dict[str, Hessian] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ-round every Linear of layer `index` on its inputs over x (the Hessians captured
    from `run_layer`, the layer as it is now, or `given`: of the first Linear of every input
    group, not `sequential`) and give each its stored values in place; returns
    {module name: its checkpoint tensors}. `report` sums the Linears' output errors."""
    if given is not None and plan.cfg.sequential:
        raise ValueError("round_layer: expected given=None with sequential, got Hessians")
    result: dict[str, dict[str, torch.Tensor]] = {}
    for stage in plan.stages:
        names = [g[0] for g in stage]
        hessians = given
        if hessians is None:
            hessians = _capture_hessians(layer, x, run_layer, names, plan.cfg.batch_sequences)
        clock.lap("capture")
        if stage[0] == plan.input_groups[0]:
            report.count_experts(expert_token_counts(plan.model, _tokens(hessians)))
        for group in stage:
            rounded = _round_group(layer, group, hessians, report, plan)
            result.update({f"model.layers.{index}.{n}": t for n, t in rounded.items()})
        clock.lap("round")
    return result


def _round_group(
    layer: nn.Module,
    group: tuple[str, ...],
    hessians: dict[str, Hessian],
    report: GptqLayerReport,
    plan: GptqPlan,
) -> dict[str, dict[str, torch.Tensor]]:
    """Round one input group's Linears and give them their stored values; returns their
    checkpoint tensors by layer-relative name."""
    scheme, cfg, scale_dtype = plan.scheme, plan.cfg, plan.scale_dtype
    result: dict[str, dict[str, torch.Tensor]] = {}
    mods = [layer.get_submodule(n) for n in group]
    # Stacked rows: Linears sharing an input share H, and rows round independently (every
    # scale and zero point is per row).
    w = torch.cat([m.weight.data for m in mods]).float()
    if hessians[group[0]].tokens == 0:
        # An expert no calibration token reached: round to nearest, same scales.
        rounder = ROUNDERS[scheme.kind](w, scheme, scale_dtype=scale_dtype)
        q = stored = rounder.stored(rounder.nearest(w))
    else:
        h = hessians[group[0]].matrix()
        ratio = _clip(w, h, group, mods, plan)
        q, rounder = gptq_weight(
            w, h, scheme=scheme, cfg=cfg, scale_dtype=scale_dtype, clip_ratio=ratio
        )
        stored = rounder.stored(q)
        report.method_error += output_error(w, stored, h)
        report.rtn_error += output_error(w, rounder.nearest(w), h)
    row = 0
    for name, m in zip(group, mods, strict=True):
        rows = slice(row, row + m.out_features)
        result[name] = rounder.tensors(q, rows, dtype=scale_dtype)
        m.weight.data = stored[rows].to(m.weight.dtype)
        row += m.out_features
    return result


def _clip(
    w: torch.Tensor, h: torch.Tensor, group: tuple[str, ...], mods: list[nn.Module], plan: GptqPlan
) -> torch.Tensor | None:
    """The clip ratios [N, K/G] of an input group's stacked rows W (`cfg.clip`; the rows of
    `no_clip` Linears keep ratio 1), or None: RTN's ranges."""
    scheme = plan.scheme
    if plan.cfg.clip == "none" or scheme.kind != "int4":
        return None
    ratio = clip_ratios(
        w,
        group_size=scheme.group_size_for(w.shape[1]),
        symmetric=scheme.symmetric,
        mode=plan.cfg.clip,
        h=h,
    )
    row = 0
    for name, m in zip(group, mods, strict=True):
        if name in plan.no_clip:
            ratio[row : row + m.out_features] = 1.0
        row += m.out_features
    return ratio


def gptq_quantize(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    arch: Family | None = None,
    scheme: QuantScheme,
    cfg: GptqConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
    on_layer: Callable[[GptqLayerReport], None] | None = None,
) -> tuple[dict[str, dict[str, torch.Tensor]], list[GptqLayerReport]]:
    """GPTQ-round every decoder Linear of a loaded `model` in place (`gptq_walk`); returns
    {module name: its checkpoint tensors (local names)} and one report per layer."""
    walk = gptq_walk(model, samples, arch=arch, scheme=scheme, cfg=cfg, scale_dtype=scale_dtype)
    return run_walk(walk, model.model.layers, on_layer)
