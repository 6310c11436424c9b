"""What the layer-by-layer quantizers (AWQ, GPTQ) share: the calibration activations entering
the first decoder layer, a decoder layer as a function of its input, chunked runs, a clock per
phase, the per-layer report's error change against round to nearest, and the end of each layer's
step (`finish_layer`), and the walk itself (`LayerWalk`, `run_walk`).

Every algorithm is a `LayerWalk`: a step that quantizes one decoder layer given the activations
entering it and returns the next layer's. The in-memory pipeline steps through a loaded model;
the streaming one builds each layer from the source files, steps it, writes it and frees it, so
both produce the same tensors from the same code. AWQ and GPTQ feed the *quantized* layer's
output to the next, so later layers calibrate against the errors they will really see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from quantkit.models.decoder import CausalLM


@dataclass
class LayerErrorReport:
    """One decoder layer's report: its error under round to nearest and under the method (each
    quantizer measures its own kind of error), and wall time per phase."""

    index: int
    rtn_error: float = 0.0
    method_error: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: capture, search, ...
    # Mixture of experts: calibration tokens the router sent to each expert, and the experts
    # that got none and were rounded to nearest (`quantize/moe.py`).
    expert_tokens: list[int] = field(default_factory=list)
    rtn_experts: list[int] = field(default_factory=list)

    def count_experts(self, tokens: list[int]) -> None:
        """Record each expert's token count; the ones with none fell back to RTN."""
        self.expert_tokens = list(tokens)
        self.rtn_experts = [e for e, n in enumerate(tokens) if n == 0]

    @property
    def loss_reduction(self) -> float:
        """1 - method/RTN of the layer's error (0.3 = 30% lower)."""
        if self.rtn_error <= 0:
            return 0.0
        return 1.0 - self.method_error / self.rtn_error


def first_layer_inputs(
    model: CausalLM, samples: torch.Tensor, *, batch_sequences: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states entering layer 0 [n, T, H], rope cos, sin for a chunk of sequences), on
    the device of the model's embedding (where the calibration runs; its rotary tables with it)."""
    n_seq, seq_len = samples.shape
    device = model.model.embed_tokens.weight.device
    positions = torch.arange(seq_len, device=device).expand(min(n_seq, batch_sequences), seq_len)
    cos, sin = model.rope(positions)
    with torch.no_grad():
        x = model.embed(samples.to(device)).to(model.dtype)
    return x, cos, sin


def layer_call(layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> Callable:
    """The decoder layer as x [B, T, H] -> [B, T, H] (causal attention, no KV cache)."""
    return lambda x: layer(x, cos[: x.shape[0]], sin[: x.shape[0]])


def run_chunked(run: Callable, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """run() over x in chunks of `chunk` sequences (bounds the activation memory)."""
    with torch.no_grad():
        return torch.cat([run(part) for part in x.split(chunk)])


class PhaseClock:
    """Accumulates wall time per phase into a dict."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def finish_layer(
    run_layer: Callable, x: torch.Tensor, chunk: int, *, clock: PhaseClock
) -> torch.Tensor:
    """The end of one layer's step: the quantized layer's output over x (in chunks of `chunk`
    sequences), the next layer's input, timed as "propagate"."""
    x = run_chunked(run_layer, x, chunk)
    clock.lap("propagate")
    return x


Weights = TypeVar("Weights")
Report = TypeVar("Report", bound=LayerErrorReport)
# step(index, layer, x) -> (the layer's quantized weights by full module name, its report, the
# next layer's input). The layer is changed in place: its Linears compute what the checkpoint
# will (dequantized weights) and norms carry any folded scales.
Step = Callable[[int, nn.Module, "torch.Tensor | None"], tuple[dict[str, Any], Any, Any]]


@dataclass
class LayerWalk:
    """An algorithm's pass over the decoder, one layer at a time (see the module docstring)."""

    step: Step
    x: torch.Tensor | None = None  # activations entering layer 0; None without calibration


def run_walk(
    walk: LayerWalk,
    layers: Iterable[nn.Module],
    on_layer: Callable[[Any], None] | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """Step through `layers` in order: every layer's weights merged, and the reports."""
    weights: dict[str, Any] = {}
    reports: list[Any] = []
    x = walk.x
    for index, layer in enumerate(layers):
        out, report, x = walk.step(index, layer, x)
        weights.update(out)
        reports.append(report)
        if on_layer is not None:
            on_layer(report)
    return weights, reports
