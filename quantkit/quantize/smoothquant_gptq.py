"""SmoothQuant's migration, then GPTQ's rounding ("smoothquant+gptq"), for W8A8 INT8: the
recipe llm-compressor's W8A8 examples run (SmoothQuantModifier, then GPTQModifier).

Per layer, SmoothQuant's step (`smoothquant.smoothquant_walk`: each group's input maxima taken,
the migration folded into the previous norm or Linear) up to its rounding; then GPTQ rounds the
smoothed Linears on their int8 per-channel scales (`gptq.round_layer` with `Int8Rounder`), the
Hessians captured on the smoothed layer, so they are those of the inputs the checkpoint's
Linears will see. With `SmoothQuantConfig.runtime_inputs` they are summed over those inputs as
the runtime rounds them (per token, to int8), and, with `GptqConfig.sequential`, after the
earlier input groups of the layer were rounded: what each Linear multiplies at run time. The
report is SmoothQuant's (the layer's W8A8 output error with plain RTN and with the method); the
W8A8 layer's output goes on to the next layer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import nn

from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family
from quantkit.quantize.gptq import GptqConfig, GptqLayerReport, gptq_plan, round_layer
from quantkit.quantize.layer_walk import LayerWalk, PhaseClock
from quantkit.quantize.smoothquant import SmoothQuantConfig, smoothquant_walk, w8a8_activations


def smoothquant_gptq_walk(
    model: CausalLM,
    samples: torch.Tensor,
    *,
    scheme: QuantScheme,
    arch: Family | None = None,
    smoothquant: SmoothQuantConfig | None = None,
    gptq: GptqConfig | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> LayerWalk:
    """SmoothQuant + GPTQ as a `LayerWalk` (module docstring): each step smooths one decoder
    layer, GPTQ-rounds its Linears to int8, gives them their stored values in place and returns
    {module name: its checkpoint tensors}."""
    smoothquant = smoothquant or SmoothQuantConfig()
    # One chunk size for every forward: the rotary tables are SmoothQuant's, made for its chunks.
    gptq = replace(gptq or GptqConfig(), batch_sequences=smoothquant.batch_sequences)
    plan = gptq_plan(model, arch=arch, scheme=scheme, cfg=gptq, scale_dtype=scale_dtype)
    linears = model.config.layer_linears()

    def stage(
        index: int, layer: nn.Module, x: torch.Tensor, run_layer: Callable
    ) -> dict[str, dict[str, torch.Tensor]]:
        linear_report = GptqLayerReport(index)  # the Linears' errors are not this walk's report
        clock = PhaseClock(linear_report.seconds)
        runtime = smoothquant.runtime_inputs
        with w8a8_activations(layer, linears) if runtime else nullcontext():
            return round_layer(plan, index, layer, x, run_layer, report=linear_report, clock=clock)

    return smoothquant_walk(
        model,
        samples,
        scheme=scheme,
        arch=arch,
        cfg=smoothquant,
        scale_dtype=scale_dtype,
        round_stage=stage,
    )
