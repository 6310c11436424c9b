"""AWQ (activation-aware weight quantization), one decoder layer at a time.

Per layer: run the calibration activations through it once, recording each scale group's input
and the fp output of the module the search inspects; grid-search the scale exponent r in
s = mean|x|^r / mean|w|^(1-r) ("duo" scaling; plain x^r without it) minimising that module's
output MSE under fake quantization; fold s into the previous op; search a clipping ratio per
(output channel, group); quantize; and feed the *quantized* layer's output to the next layer, so
later layers calibrate against the errors they will really see. Peak memory is one layer's
activations plus the model.

Cost (why the search subsamples): at 128 x 512 calibration tokens a full-batch search would
re-run every block 20 times over 65k tokens, hundreds of TFLOP. The statistics use every
token; the search loss uses `search_tokens` tokens (whole sequences for attention, random
tokens for the token-wise MLP), and the clip search `clip_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.format.packing import fake_quantize_int4
from quantkit.format.scheme import QuantScheme
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
    run_walk,
)
from quantkit.quantize.moe import expert_linears, expert_token_counts
from quantkit.quantize.rtn import Int4Weights, rtn_quantize_weight
from quantkit.quantize.scale_groups import fold_scale as _fold
from quantkit.quantize.scale_groups import model_scale_groups as _model_scale_groups


@dataclass(frozen=True)
class AwqConfig:
    grid: int = 20
    duo_scaling: bool = True
    search_tokens: int = 4096
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    batch_sequences: int = 16  # sequences per forward chunk (bounds activation memory)
    seed: int = 0


@dataclass
class GroupReport:
    linears: tuple[str, ...]
    ratio: float | None  # best exponent; None when identity (no scaling) won
    rtn_loss: float
    awq_loss: float


@dataclass
class LayerReport(LayerErrorReport):
    """rtn_error / method_error: the layer-output MSE on the search tokens with RTN and AWQ."""

    groups: list[GroupReport] = field(default_factory=list)


def _fake(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    return fake_quantize_int4(
        w, group_size=scheme.group_size_for(w.shape[1]), symmetric=scheme.symmetric
    )


class _Capture:
    """Forward hooks on a layer's submodules: keep a subsample of inputs, sum |x| per channel."""

    def __init__(self, layer: nn.Module, names: list[str], keep: dict[str, torch.Tensor | int]):
        self.sums: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.kept: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        # name -> token indices into the flattened chunk, or (a Linear called on a varying
        # subset of tokens: an expert's) the number of its first tokens to keep
        self.keep = keep
        self.offset = 0
        self.handles = [layer.get_submodule(n).register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
            x = args[0].detach()
            flat = x.reshape(-1, x.shape[-1])
            self.sums[name] = self.sums.get(name, 0) + flat.abs().sum(0)
            self.count[name] = self.count.get(name, 0) + flat.shape[0]
            idx = self.keep[name]
            if isinstance(idx, int):
                room = idx - sum(len(t) for t in self.kept[name])
                self.kept[name].append(flat[: max(room, 0)])
            else:
                lo, hi = self.offset, self.offset + flat.shape[0]
                sel = idx[(idx >= lo) & (idx < hi)] - lo
                self.kept[name].append(flat[sel])

        return hook

    def mean_abs(self, name: str) -> torch.Tensor:
        return self.sums[name] / self.count[name]

    def tokens(self, name: str) -> int:
        """Tokens the module saw (0 for an expert the router never picked)."""
        return self.count.get(name, 0)

    def tensor(self, name: str) -> torch.Tensor:
        return torch.cat(self.kept[name], dim=0)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _search_scale(
    group: ScaleGroup,
    layer: nn.Module,
    x_mean: torch.Tensor,
    x_search: torch.Tensor,
    run: Callable[[torch.Tensor], torch.Tensor],
    *,
    scheme: QuantScheme,
    cfg: AwqConfig,
) -> tuple[torch.Tensor | None, GroupReport]:
    """Best per-input-channel scale for one group (None = identity), and its losses."""
    linears = [layer.get_submodule(n) for n in group.linears]
    originals = [m.weight.data.clone() for m in linears]
    with torch.no_grad():
        target = run(x_search)

        def loss_with(s: torch.Tensor | None) -> float:
            for m, w in zip(linears, originals, strict=True):
                m.weight.data = _fake(w, scheme) if s is None else _fake(w * s, scheme) / s
            out = run(x_search)
            return float((out - target).float().pow(2).mean())

        w_all = torch.cat(originals, dim=0)
        g = scheme.group_size_for(w_all.shape[1])
        wg = w_all.abs().view(w_all.shape[0], -1, g)
        w_mean = (wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-8)).view_as(w_all).mean(0)
        rtn_loss = loss_with(None)
        best_loss, best_ratio, best_s = rtn_loss, None, None
        for i in range(cfg.grid):
            r = i / cfg.grid
            if cfg.duo_scaling:
                s = x_mean.pow(r) / w_mean.pow(1 - r).clamp(min=1e-4)
            else:
                s = x_mean.pow(r)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            loss = loss_with(s)
            if loss < best_loss:
                best_loss, best_ratio, best_s = loss, r, s
        for m, w in zip(linears, originals, strict=True):
            m.weight.data = w
    return best_s, GroupReport(group.linears, best_ratio, rtn_loss, best_loss)


def _search_clip(w: torch.Tensor, x: torch.Tensor, *, scheme: QuantScheme, cfg: AwqConfig):
    """Per (output channel, group) clip ratio in [max_shrink, 1] minimising the group's partial
    output error on tokens x [T, K]. Returns a [N, G] ratio tensor."""
    n, k = w.shape
    g = scheme.group_size_for(k)
    groups = k // g
    xg = x.view(-1, groups, g).transpose(0, 1)  # [G, T, g]
    best_err = torch.full((groups, n), float("inf"), device=w.device)
    best = torch.ones(groups, n, device=w.device)
    steps = int(cfg.clip_grid * (1 - cfg.max_shrink))
    with torch.no_grad():
        for i in range(steps + 1):
            ratio = 1 - i / cfg.clip_grid
            wq = fake_quantize_int4(w, group_size=g, symmetric=scheme.symmetric, clip_ratio=ratio)
            diff = (wq - w).view(n, groups, g).permute(1, 2, 0)  # [G, g, N]
            err = torch.bmm(xg, diff).pow(2).mean(dim=1)  # [G, N]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, torch.full_like(best, ratio), best)
    return best.T.contiguous()


@dataclass(frozen=True)
class _SearchPicks:
    """The calibration subsets the searches run on, drawn once for all layers."""

    seqs: torch.Tensor  # whole sequences: the attention search and the layer-output MSE
    tokens: torch.Tensor  # sorted flat token indices: the token-wise modules' search
    clip_rows: torch.Tensor  # rows of the kept `tokens`: the clip search


def _draw_picks(n_seq: int, seq_len: int, cfg: AwqConfig) -> _SearchPicks:
    # One generator seeded once, drawn in this order: the picks are a function of cfg.seed.
    gen = torch.Generator().manual_seed(cfg.seed)
    search_seqs = max(1, min(n_seq, cfg.search_tokens // seq_len))
    seq_pick = torch.randperm(n_seq, generator=gen)[:search_seqs]
    total = n_seq * seq_len
    tok_pick = torch.randperm(total, generator=gen)[: min(total, cfg.search_tokens)].sort().values
    # The clip search uses a random subset of the search tokens.
    clip_rows = torch.randperm(len(tok_pick), generator=gen)[: cfg.clip_tokens]
    return _SearchPicks(seq_pick, tok_pick, clip_rows)


@dataclass(frozen=True)
class AwqPlan:
    """What every layer's pass shares: the settings, the groups and Linears to quantize, the
    search subsets and the rotary tables."""

    model: CausalLM
    arch: Family
    scheme: QuantScheme
    cfg: AwqConfig
    groups: list[ScaleGroup]
    linears: tuple[str, ...]
    routed: frozenset[str]  # expert Linears: called on a varying subset of the tokens
    picks: _SearchPicks
    cos: torch.Tensor
    sin: torch.Tensor
    seq_len: int


def awq_plan(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    scheme: QuantScheme,
    arch: Family | None = None,
    cfg: AwqConfig | None = None,
) -> tuple[AwqPlan, torch.Tensor]:
    """What every layer's pass shares, and the activations entering the first layer."""
    arch = arch or model.family
    cfg = cfg or AwqConfig()
    n_seq, seq_len = samples.shape
    x, cos, sin = first_layer_inputs(model, samples, batch_sequences=cfg.batch_sequences)
    picks = _draw_picks(n_seq, seq_len, cfg)
    groups = _model_scale_groups(model, arch)
    linears, routed = model.config.layer_linears(), expert_linears(model)
    plan = AwqPlan(model, arch, scheme, cfg, groups, linears, routed, picks, cos, sin, seq_len)
    return plan, x


def awq_walk(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    scheme: QuantScheme,
    arch: Family | None = None,
    cfg: AwqConfig | None = None,
) -> LayerWalk:
    """AWQ as a `LayerWalk`: each step quantizes one decoder layer in place (weights become
    their dequantized values, norms absorb the scales) and returns its INT4 weights by module
    name. `model` supplies the embedding, the rotary tables and the config; its decoder layers
    are passed to the step one at a time. The Linears and scale groups are the family's (`arch`,
    default `model.family`)."""
    plan, x = awq_plan(model, samples, scheme=scheme, arch=arch, cfg=cfg)

    def step(
        index: int, layer: nn.Module, x: torch.Tensor | None
    ) -> tuple[dict[str, Int4Weights], LayerReport, torch.Tensor]:
        assert x is not None
        result: dict[str, Int4Weights] = {}
        report, x = _quantize_layer(plan, index, layer, x, result)
        return result, report, x

    return LayerWalk(step, x)


def awq_quantize(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    scheme: QuantScheme,
    arch: Family | None = None,
    cfg: AwqConfig | None = None,
    on_layer: Callable[[LayerReport], None] | None = None,
) -> tuple[dict[str, Int4Weights], list[LayerReport]]:
    """Quantize every decoder Linear of a loaded `model` in place (`awq_walk`) and return the
    INT4 weights by module name, with one report per layer."""
    walk = awq_walk(model, samples, scheme=scheme, arch=arch, cfg=cfg)
    return run_walk(walk, model.model.layers, on_layer)


def _quantize_layer(
    plan: AwqPlan,
    index: int,
    layer: nn.Module,
    x: torch.Tensor,
    result: dict[str, Int4Weights],
) -> tuple[LayerReport, torch.Tensor]:
    """One layer's pass: capture, RTN baseline, scale search and fold, clip and quantize (into
    `result`); returns its report and the quantized layer's output, the next layer's input."""
    cfg = plan.cfg
    report = LayerReport(index)
    clock = PhaseClock(report.seconds)
    scaled = capture_and_scale(plan, layer, x, report, clock)
    result.update(clip_and_quantize(plan, index, layer, scaled.cap))
    clock.lap("clip_and_quantize")
    out_q = run_chunked(scaled.run_layer, scaled.x_attn_seq, cfg.batch_sequences)
    report.method_error = float((out_q - scaled.layer_target).pow(2).mean())
    # Feed the quantized layer's output onward.
    return report, finish_layer(scaled.run_layer, x, cfg.batch_sequences, clock=clock)


@dataclass
class ScaledLayer:
    """A layer after AWQ's capture and scale search, its scales folded, nothing rounded yet."""

    cap: _Capture  # the inputs seen (search subsets, divided by the folded scales) and mean |x|
    run_layer: Callable[[torch.Tensor], torch.Tensor]
    x_attn_seq: torch.Tensor  # the search sequences' inputs: the layer-output MSE's tokens
    layer_target: torch.Tensor  # the unquantized layer's output on them


def capture_and_scale(
    plan: AwqPlan,
    layer: nn.Module,
    x: torch.Tensor,
    report: LayerReport,
    clock: PhaseClock,
    *,
    observe: dict[str, Callable[[torch.Tensor], None]] | None = None,
    on_fold: Callable[[ScaleGroup, torch.Tensor], None] | None = None,
) -> ScaledLayer:
    """The first half of a layer's pass: capture, the RTN baseline (`report.rtn_error`), and
    each group's scale searched and folded (`report.groups`). `observe`: module name -> a
    function also given every input of that module in the capture pass; `on_fold(group, s)`:
    called after each fold (the group's Linears now get their inputs divided by s)."""
    cfg = plan.cfg
    inputs = {g.input or g.linears[0] for g in plan.groups} | set(plan.linears)
    keep: dict[str, torch.Tensor | int] = {
        name: cfg.search_tokens if name in plan.routed else plan.picks.tokens for name in inputs
    }
    cap = _Capture(layer, sorted(inputs), keep)
    handles = [
        layer.get_submodule(name).register_forward_pre_hook(lambda _m, args, f=f: f(args[0]))
        for name, f in (observe or {}).items()
    ]
    run_layer = layer_call(layer, plan.cos, plan.sin)
    try:
        with torch.no_grad():
            for chunk in x.split(cfg.batch_sequences):
                run_layer(chunk)
                cap.offset += chunk.shape[0] * plan.seq_len
    finally:
        for handle in handles:
            handle.remove()
    cap.close()
    report.count_experts(expert_token_counts(plan.model, cap.tokens))
    clock.lap("capture")
    x_attn_seq = x[plan.picks.seqs]
    layer_target = run_chunked(run_layer, x_attn_seq, cfg.batch_sequences)
    report.rtn_error = _rtn_output_mse(
        layer, plan.linears, run_layer, x_attn_seq, layer_target, scheme=plan.scheme, cfg=cfg
    )
    clock.lap("baseline")
    report.groups.extend(_scale_layer(plan, layer, cap, x_attn_seq, on_fold))
    clock.lap("scale_search")
    return ScaledLayer(cap, run_layer, x_attn_seq, layer_target)


def _scale_layer(
    plan: AwqPlan,
    layer: nn.Module,
    cap: _Capture,
    x_attn_seq: torch.Tensor,
    on_fold: Callable[[ScaleGroup, torch.Tensor], None] | None = None,
) -> list[GroupReport]:
    """Search each group's scale in turn and fold it into the layer (a later group searches on
    the layer as the earlier folds left it); returns one report per searched group."""
    arch, cos, sin = plan.arch, plan.cos, plan.sin
    reports: list[GroupReport] = []
    for group in plan.groups:
        first = group.input or group.linears[0]
        if cap.tokens(first) == 0:
            continue  # an expert no calibration token reached: no statistics, RTN
        if group.inspect == arch.attention:
            # Attention mixes tokens: search on whole sequences, not sampled tokens.
            with torch.no_grad():
                search_x = layer.get_submodule(group.prev)(x_attn_seq)
            attention = layer.get_submodule(arch.attention)

            def run(z: torch.Tensor, attn: nn.Module = attention) -> torch.Tensor:
                return torch.cat([attn(part, cos[:1], sin[:1]) for part in z.split(8)])
        else:
            search_x = cap.tensor(first)  # [search tokens, K], token-wise modules
            run = layer.get_submodule(group.inspect)
        s, group_report = _search_scale(
            group, layer, cap.mean_abs(first), search_x, run, scheme=plan.scheme, cfg=plan.cfg
        )
        reports.append(group_report)
        if s is not None:
            _fold(layer, group, s)
            if on_fold is not None:
                on_fold(group, s)
            # The captured inputs of these linears now arrive divided by s.
            for name in group.linears:
                cap.kept[name] = [t / s for t in cap.kept[name]]
    return reports


def clip_and_quantize(
    plan: AwqPlan, index: int, layer: nn.Module, cap: _Capture
) -> dict[str, Int4Weights]:
    """Quantize each Linear of layer `index` (after its clip search) and give it its
    dequantized weight, so the layer's output is what the checkpoint will compute; returns the
    INT4 weights by module name."""
    cfg, scheme = plan.cfg, plan.scheme
    result: dict[str, Int4Weights] = {}
    for name in plan.linears:
        w = layer.get_submodule(name).weight.data
        ratio: float | torch.Tensor = 1.0
        if cfg.clip and name not in plan.arch.no_clip and cap.tokens(name) > 0:
            seen = cap.tensor(name)
            x_clip = seen[: cfg.clip_tokens] if name in plan.routed else seen[plan.picks.clip_rows]
            ratio = _search_clip(w, x_clip, scheme=scheme, cfg=cfg)
        q = rtn_quantize_weight(w, scheme=scheme, clip_ratio=ratio)
        result[f"model.layers.{index}.{name}"] = q
        layer.get_submodule(name).weight.data = q.dequantize(
            group_size=scheme.group_size_for(w.shape[1]), dtype=w.dtype
        )
    return result


def _rtn_output_mse(
    layer: nn.Module,
    linears: tuple[str, ...],
    run_layer: Callable,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    scheme: QuantScheme,
    cfg: AwqConfig,
) -> float:
    """Layer-output MSE with plain RTN of the original weights (the per-layer baseline)."""
    mods = [layer.get_submodule(n) for n in linears]
    originals = [m.weight.data for m in mods]
    for m, w in zip(mods, originals, strict=True):
        m.weight.data = _fake(w, scheme)
    out = run_chunked(run_layer, x, cfg.batch_sequences)
    for m, w in zip(mods, originals, strict=True):
        m.weight.data = w
    return float((out - target).pow(2).mean())
