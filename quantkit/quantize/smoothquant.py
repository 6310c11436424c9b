"""SmoothQuant (Xiao et al. 2023): activation outliers moved into the weights, for W8A8 INT8.

Per-token int8 activations lose the small channels of a token whose few outlier channels set
its scale; per-channel int8 weights have room to spare. SmoothQuant divides each input channel
j of a group of Linears by s_j and multiplies their weight columns by it, with

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

(max|X_j| over the calibration tokens entering the group, max|W_j| over the group's weight
rows; alpha = 0.5 splits the range evenly). The division is folded into the op before the
group exactly as AWQ folds its scales (`scale_groups.fold_scale`: a norm's weight, or the rows
of a previous Linear), over the same scale groups (`scale_groups.model_scale_groups`), so the
float model computes the same function; then every Linear is rounded to nearest on its
per-channel int8 scale, stored as the checkpoint stores it.

One decoder layer at a time (`smoothquant_walk`): the calibration activations entering the
layer are run through it once to take each group input's per-channel max, the groups are
smoothed, the Linears rounded (to nearest, or by a `RoundStage` given: GPTQ on the smoothed
layer, `smoothquant_gptq`), and the layer's W8A8 output (weights dequantized, activations
rounded per token as at run time) is the next layer's input. The per-layer report compares the
layer's W8A8 output error on `report_sequences` sequences with plain RTN (no smoothing) and
with SmoothQuant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.format.int8 import INT8
from quantkit.format.packing import dequantize_int8, int8_absmax, int8_codes, int8_row_scale
from quantkit.format.scheme import QuantScheme
from quantkit.format.weight_format import Codes
from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family, ScaleGroup
from quantkit.quantize.layer_walk import (
    LayerErrorReport,
    LayerWalk,
    PhaseClock,
    finish_layer,
    first_layer_inputs,
    layer_call,
    run_chunked,
)
from quantkit.quantize.moe import expert_token_counts
from quantkit.quantize.scale_groups import fold_scale, model_scale_groups

# (index, the smoothed layer, the activations entering it [n, T, H], the layer as a function of
# them) -> {module name: its checkpoint tensors}, the layer's Linears given their stored values.
RoundStage = Callable[[int, nn.Module, torch.Tensor, Callable], dict[str, dict[str, torch.Tensor]]]

# Bounds of max|X_j| and max|W_j| before the powers: a channel that never fires or a weight
# column of zeros keeps s_j = 1 (nothing to move), and no s_j divides by zero.
_TINY = 1e-5


@dataclass(frozen=True)
class SmoothQuantConfig:
    # Migration strength: 0 leaves the activations, 1 moves all into W. SmolLM2-135M W8A8,
    # 8192 held-out tokens (evals/studies/int8_quality.py; reference 15.176): 0.75 gave +1.43%
    # with round to nearest (0.5: +1.64%) and +0.72% with GPTQ after it; with only the
    # activations rounded, 0.75 left +0.42%, 0.5 +1.23% and 0.9 +0.48%.
    alpha: float = 0.75
    # Smooth the groups whose previous op is a Linear (up -> down; v -> o without GQA) too,
    # not only those after a norm (the paper's and llm-compressor's default mappings).
    linear_prev: bool = True
    batch_sequences: int = 16  # sequences per forward chunk (bounds activation memory)
    report_sequences: int = 8  # sequences the per-layer error report runs on
    # smoothquant+gptq: GPTQ's Hessians summed over the inputs as the runtime rounds them (per
    # token, to int8), not the float ones (`smoothquant_gptq`).
    runtime_inputs: bool = True


@dataclass
class SmoothQuantLayerReport(LayerErrorReport):
    """rtn_error / method_error: the layer-output MSE of the W8A8 layer on the report
    sequences, with plain RTN and with SmoothQuant; `smoothed`: the groups scaled (by their
    Linears)."""

    smoothed: list[tuple[str, ...]] = field(default_factory=list)


def smoothing_scale(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), 1 where either is 0 (fp32, [K])."""
    x, w = x_max.float(), w_max.float()
    s = x.clamp(min=_TINY).pow(alpha) / w.clamp(min=_TINY).pow(1 - alpha)
    return torch.where((x > 0) & (w > 0), s, torch.ones_like(s))


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded to int8 per token (row absmax / 127) and back, in x's dtype: the
    activations a W8A8 Linear multiplies."""
    codes, scale = int8_absmax(x)
    return (codes.float() * scale).to(x.dtype)


@contextmanager
def w8a8_activations(layer: nn.Module, linears: tuple[str, ...]) -> Iterator[None]:
    """While open, the `linears` of `layer` see their inputs rounded as W8A8 rounds them."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (fake_quantize_tokens(args[0]), *args[1:])

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook) for n in linears]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _MaxCapture:
    """Forward pre-hooks keeping each module's per-channel max |input| and token count."""

    def __init__(self, layer: nn.Module, names: list[str]) -> None:
        self.max: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.handles = [
            layer.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names
        ]

    def _hook(self, name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            flat = args[0].detach().reshape(-1, args[0].shape[-1])
            if flat.shape[0] == 0:
                return
            m = flat.abs().amax(0).float()
            self.max[name] = torch.maximum(self.max[name], m) if name in self.max else m
            self.count[name] = self.count.get(name, 0) + flat.shape[0]

        return hook

    def tokens(self, name: str) -> int:
        return self.count.get(name, 0)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _input_of(group: ScaleGroup) -> str:
    return group.input or group.linears[0]


def capture_input_max(
    layer: nn.Module, run_layer: Callable, x: torch.Tensor, names: list[str], chunk: int
) -> _MaxCapture:
    """Per-channel max |input| of each module in `names` over x [n, T, H] (the layer's output
    is discarded)."""
    cap = _MaxCapture(layer, names)
    try:
        run_chunked(run_layer, x, chunk)
    finally:
        cap.close()
    return cap


def smooth_layer(
    layer: nn.Module, groups: list[ScaleGroup], cap: _MaxCapture, *, cfg: SmoothQuantConfig
) -> list[tuple[str, ...]]:
    """Fold each group's smoothing scale into `layer` (from the inputs' maxima `cap` took
    before any fold: a fold leaves every other group's input unchanged); returns the groups
    smoothed, by their Linears (a group no calibration token reached is left alone, and one
    after a Linear unless `cfg.linear_prev`)."""
    done: list[tuple[str, ...]] = []
    for group in groups:
        name = _input_of(group)
        after_linear = isinstance(layer.get_submodule(group.prev), nn.Linear)
        if cap.tokens(name) == 0 or (after_linear and not cfg.linear_prev):
            continue
        weights = [layer.get_submodule(n).weight.detach() for n in group.linears]
        w_max = torch.cat(weights).abs().amax(0)
        fold_scale(layer, group, smoothing_scale(cap.max[name], w_max, cfg.alpha))
        done.append(group.linears)
    return done


def smooth_model(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    cfg: SmoothQuantConfig | None = None,
    arch: Family | None = None,
) -> None:
    """Smooth every decoder layer of `model` in place, without rounding anything: the float
    model computes the same function (up to fp32 rounding), its Linears' inputs flatter."""
    arch = arch or model.family
    cfg = cfg or SmoothQuantConfig()
    x, cos, sin = first_layer_inputs(model, samples, batch_sequences=cfg.batch_sequences)
    groups = model_scale_groups(model, arch)
    names = sorted({_input_of(g) for g in groups})
    for layer in model.model.layers:
        run_layer = layer_call(layer, cos, sin)
        cap = capture_input_max(layer, run_layer, x, names, cfg.batch_sequences)
        smooth_layer(layer, groups, cap, cfg=cfg)
        x = run_chunked(run_layer, x, cfg.batch_sequences)


def _round_int8(w: torch.Tensor, dtype: torch.dtype) -> tuple[Codes, torch.Tensor]:
    """Round-to-nearest int8 codes of W on its per-row scale as `dtype` stores it, and the
    dequantized weight the checkpoint computes with (fp32)."""
    scale = int8_row_scale(w).to(dtype).float()
    codes = int8_codes(w, scale)
    return Codes(codes, scale, None), dequantize_int8(codes, scale)


def smoothquant_walk(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    scheme: QuantScheme,
    arch: Family | None = None,
    cfg: SmoothQuantConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
    round_stage: RoundStage | None = None,
) -> LayerWalk:
    """SmoothQuant + round to nearest as a `LayerWalk`: each step smooths one decoder layer,
    rounds its Linears to int8 (scales stored in `scale_dtype`; with `round_stage`, as it
    rounds them), gives them their dequantized values in place and returns {module name: its
    checkpoint tensors (local names)}."""
    if scheme.kind != INT8.kind:
        raise ValueError(f"smoothquant: expected an int8 scheme, got {scheme.describe()}")
    arch = arch or model.family
    cfg = cfg or SmoothQuantConfig()
    x, cos, sin = first_layer_inputs(model, samples, batch_sequences=cfg.batch_sequences)
    groups = model_scale_groups(model, arch)
    linears = model.config.layer_linears()
    # Every Linear's input too: the experts' token counts.
    names = sorted({_input_of(g) for g in groups} | set(linears))
    report_rows = torch.arange(min(cfg.report_sequences, samples.shape[0]), device=x.device)

    def nearest(
        index: int, layer: nn.Module, x: torch.Tensor, run_layer: Callable
    ) -> dict[str, dict[str, torch.Tensor]]:
        result: dict[str, dict[str, torch.Tensor]] = {}
        for name in linears:
            m = layer.get_submodule(name)
            q, stored = _round_int8(m.weight.data, scale_dtype)
            result[f"model.layers.{index}.{name}"] = INT8.pack(q, scheme, dtype=scale_dtype)
            m.weight.data = stored.to(m.weight.dtype)
        return result

    def w8a8_output(layer: nn.Module, run_layer: Callable, xs: torch.Tensor) -> torch.Tensor:
        with w8a8_activations(layer, linears):
            return run_chunked(run_layer, xs, cfg.batch_sequences)

    def step(
        index: int, layer: nn.Module, x: torch.Tensor | None
    ) -> tuple[dict[str, dict[str, torch.Tensor]], SmoothQuantLayerReport, torch.Tensor]:
        assert x is not None
        report = SmoothQuantLayerReport(index)
        clock = PhaseClock(report.seconds)
        run_layer = layer_call(layer, cos, sin)
        cap = capture_input_max(layer, run_layer, x, names, cfg.batch_sequences)
        report.count_experts(expert_token_counts(model, cap.tokens))
        clock.lap("capture")
        x_report = x[report_rows]
        target = run_chunked(run_layer, x_report, cfg.batch_sequences)
        mods = [layer.get_submodule(n) for n in linears]
        originals = [m.weight.data for m in mods]
        for m in mods:
            m.weight.data = _round_int8(m.weight.data, scale_dtype)[1].to(m.weight.dtype)
        report.rtn_error = float((w8a8_output(layer, run_layer, x_report) - target).pow(2).mean())
        for m, w in zip(mods, originals, strict=True):
            m.weight.data = w
        clock.lap("baseline")
        report.smoothed = smooth_layer(layer, groups, cap, cfg=cfg)
        clock.lap("smooth")
        stage = round_stage or nearest
        result = stage(index, layer, x, run_layer)
        clock.lap("round")
        report.method_error = float(
            (w8a8_output(layer, run_layer, x_report) - target).pow(2).mean()
        )
        # Feed the W8A8 layer's output onward.
        with w8a8_activations(layer, linears):
            x = finish_layer(run_layer, x, cfg.batch_sequences, clock=clock)
        return result, report, x

    return LayerWalk(step, x)
