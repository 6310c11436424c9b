"""The roofline of one measured generation: what `quantkit generate` prints under its output."""

from __future__ import annotations

import math

import torch

from quantkit.errors import HardwareError
from quantkit.models.decoder import CausalLM
from quantkit.perf.hardware import local_hardware
from quantkit.perf.roofline import DecodeRoofline, decode_roofline
from quantkit.runtime.stats import GenerationStats


def generation_roofline(
    model: CausalLM, stats: GenerationStats, device: torch.device
) -> DecodeRoofline | None:
    """`model`'s decode roofline at the rate `stats` measured, or None on a GPU missing from
    the hardware table (the rate is then reported without a ceiling). With speculation the rate
    is model calls per second, since each call reads the weights once."""
    # Decode step k attends to prompt + k tokens: the mean context over the timed steps.
    context = stats.prompt_tokens // stats.batch_size + stats.generated_tokens // 2
    rate = stats.decode_tok_s if stats.decode_latencies_s else math.nan
    if stats.speculation is not None and stats.speculation.tokens_per_step > 0:
        rate /= stats.speculation.tokens_per_step
    try:
        hardware = local_hardware(device)
    except HardwareError:
        return None
    return decode_roofline(
        model, achieved_tok_s=rate, context=context, hardware=hardware, batch=stats.batch_size
    )
