"""AWQ's scales, then GPTQ's rounding ("awq+gptq"), one decoder layer at a time, optionally
keeping per layer whichever of AWQ, AWQ+GPTQ and GPTQ measured best.

Per layer: AWQ's pass up to its fold (`awq.capture_and_scale`: capture, the RTN baseline, each
scale group's activation-aware scale searched and folded into the previous op), so the layer
computes the same function with weights W * s whose salient input channels got larger; then
GPTQ on those scaled weights (`gptq.round_layer`), each group's range clipped by
`GptqConfig.clip` (`clip_search`: `output` is AWQ's clip objective on every calibration token,
read from the Hessian) and the codes rounded error-compensated on the clipped scales.

One forward serves both: the Hessians are summed in AWQ's capture pass (the first Linear of
every GPTQ input group), and each fold of s turns the H of the Linears it scaled into
diag(1/s) H diag(1/s), what a capture after the fold would have summed (`sequential` GPTQ
captures again after each group instead).

`candidates` (the per-layer choice): each named way of quantizing the layer is tried from the
same capture, and the one whose layer output over AWQ's search sequences is closest to the
unquantized layer's is kept: `awq+gptq` (above), `awq` (AWQ's own clip search and round to
nearest on the folded weights: `awq` exactly) and `gptq` (GPTQ on the layer before the fold,
on the Hessians before the fold: `gptq` exactly, without `sequential`). The report is AWQ's (the
layer-output MSE on the search sequences with RTN of the original weights and with the method),
plus the candidate kept and each one's error; the kept layer's output goes on to the next layer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family, ScaleGroup
from quantkit.quantize.awq import (
    AwqConfig,
    AwqPlan,
    LayerReport,
    ScaledLayer,
    awq_plan,
    capture_and_scale,
    clip_and_quantize,
)
from quantkit.quantize.gptq import (
    GptqConfig,
    GptqLayerReport,
    GptqPlan,
    Hessian,
    gptq_plan,
    hessian_for,
    round_layer,
)
from quantkit.quantize.layer_walk import LayerWalk, PhaseClock, finish_layer, run_chunked

CANDIDATES = ("awq+gptq", "awq", "gptq")
ModuleTensors = dict[str, dict[str, torch.Tensor]]


@dataclass
class AwqGptqLayerReport(LayerReport):
    """AWQ's report, plus the candidate kept and every candidate's layer-output MSE."""

    chosen: str = "awq+gptq"
    errors: dict[str, float] = field(default_factory=dict)


@dataclass
class _Folds:
    """The Hessians summed in AWQ's capture pass (before any fold), and the scale each input
    has been divided by since (1 where no fold touched it)."""

    hessians: dict[str, Hessian]
    scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def on_fold(self, group: ScaleGroup, s: torch.Tensor) -> None:
        for name in group.linears:
            if name in self.hessians:
                self.scales[name] = self.scales.get(name, 1.0) * s.double()

    def folded(self) -> dict[str, Hessian]:
        """The Hessians of the inputs as they arrive after the folds: diag(1/s) H diag(1/s)."""
        out: dict[str, Hessian] = {}
        for name, h in self.hessians.items():
            if name not in self.scales:
                out[name] = h
                continue
            inverse = 1.0 / self.scales[name]
            scaled = Hessian(h.sum.shape[0], device=h.sum.device)
            scaled.sum = h.sum * (inverse.view(-1, 1) * inverse.view(1, -1))
            scaled.tokens = h.tokens
            out[name] = scaled
        return out


def awq_gptq_walk(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    scheme: QuantScheme,
    arch: Family | None = None,
    awq: AwqConfig | None = None,
    gptq: GptqConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
    candidates: tuple[str, ...] = ("awq+gptq",),
) -> LayerWalk:
    """AWQ scaling + GPTQ rounding as a `LayerWalk` (module docstring): each step quantizes one
    decoder layer in place (norms carry the scales, Linears their stored values) and returns
    {module name: its checkpoint tensors}, with an `AwqGptqLayerReport`. With several
    `candidates` (of `CANDIDATES`) each layer keeps the best."""
    if scheme.kind != "int4":
        raise ValueError(f"awq+gptq: expected an int4 scheme, got {scheme.kind}")
    unknown = [c for c in candidates if c not in CANDIDATES]
    if not candidates or unknown:
        raise ValueError(f"candidates: expected some of {', '.join(CANDIDATES)}, got {candidates}")
    awq = awq or AwqConfig()
    gptq = gptq or GptqConfig()
    aplan, x = awq_plan(model, samples, scheme=scheme, arch=arch, cfg=awq)
    # One chunk size for every forward: the rotary tables are AWQ's, made for its chunks.
    gptq = replace(gptq, batch_sequences=awq.batch_sequences)
    gplan = gptq_plan(model, arch=arch, scheme=scheme, cfg=gptq, scale_dtype=scale_dtype)
    if gptq.sequential and "gptq" in candidates:
        raise ValueError("candidates: gptq needs the Hessians before the fold, not sequential")

    def step(
        index: int, layer: nn.Module, x: torch.Tensor | None
    ) -> tuple[ModuleTensors, AwqGptqLayerReport, torch.Tensor]:
        assert x is not None
        report = AwqGptqLayerReport(index)
        clock = PhaseClock(report.seconds)
        folds = None
        if not gptq.sequential:  # one forward for both
            folds = _Folds({g[0]: hessian_for(layer, g[0]) for g in gplan.input_groups})
        before = copy.deepcopy(layer.state_dict()) if "gptq" in candidates else None
        scaled = capture_and_scale(
            aplan,
            layer,
            x,
            report,
            clock,
            observe=None if folds is None else {n: h.add for n, h in folds.hessians.items()},
            on_fold=None if folds is None else folds.on_fold,
        )
        folded = copy.deepcopy(layer.state_dict()) if len(candidates) > 1 else None
        pre = None if folds is None else folds.hessians  # before the folds
        post = None if folds is None else folds.folded()
        ways: dict[str, Callable[[], ModuleTensors]] = {
            "awq+gptq": lambda: _gptq(gplan, index, layer, x, scaled, post),
            "awq": lambda: _awq(aplan, index, layer, scaled, scale_dtype),
            "gptq": lambda: _gptq(gplan, index, layer, x, scaled, pre),
        }
        best: tuple[float, str, ModuleTensors, dict[str, torch.Tensor] | None] | None = None
        for name in candidates:
            start = before if name == "gptq" else folded
            if start is not None:
                layer.load_state_dict(start)
            result = ways[name]()
            out = run_chunked(scaled.run_layer, scaled.x_attn_seq, awq.batch_sequences)
            report.errors[name] = float((out - scaled.layer_target).pow(2).mean())
            clock.lap(name)
            if best is None or report.errors[name] < best[0]:
                state = copy.deepcopy(layer.state_dict()) if len(candidates) > 1 else None
                best = (report.errors[name], name, result, state)
        assert best is not None
        report.method_error, report.chosen, result, state = best
        if state is not None:
            layer.load_state_dict(state)
        return result, report, finish_layer(scaled.run_layer, x, awq.batch_sequences, clock=clock)

    return LayerWalk(step, x)


def _gptq(
    plan: GptqPlan,
    index: int,
    layer: nn.Module,
    x: torch.Tensor,
    scaled: ScaledLayer,
    hessians: dict[str, Hessian] | None,
) -> ModuleTensors:
    """GPTQ-round the layer as it is (its Hessians given, or captured now)."""
    linears = GptqLayerReport(index)  # the Linears' own output errors are not this report's
    clock = PhaseClock(linears.seconds)
    return round_layer(
        plan, index, layer, x, scaled.run_layer, report=linears, clock=clock, given=hessians
    )


def _awq(
    plan: AwqPlan, index: int, layer: nn.Module, scaled: ScaledLayer, dtype: torch.dtype
) -> ModuleTensors:
    """AWQ's clip search and round to nearest of the folded layer, as checkpoint tensors."""
    weights = clip_and_quantize(plan, index, layer, scaled.cap)
    return {n: q.tensors(scheme=plan.scheme, dtype=dtype) for n, q in weights.items()}
