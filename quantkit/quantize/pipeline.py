"""Quantize a model end to end: load, calibrate, run the chosen algorithm (rtn / awq / gptq,
from `quantkit.quantize.algorithms`) for the chosen format, build the checkpoint tensors.

The CLI adds evaluation and writes the checkpoint (`quantize_and_save` does both for callers
that want the same result without the CLI); this module's `quantize_model` knows nothing about
either, so tests and scripts can call it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.format.checkpoint import (
    LoadedCheckpoint,
    dequantize_checkpoint_tensors,
    save_checkpoint,
    tensor_nbytes,
)
from quantkit.format.dtypes import DTYPES
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM, build_model
from quantkit.quantize.algorithms import QuantizeJob, algorithm_for
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.layer_walk import LayerErrorReport, run_walk
from quantkit.quantize.smoothquant import SmoothQuantConfig
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.sources.resolve import check_layer_count, load_state_dict, read_config

# What a layer-by-layer quantizer reports after each decoder layer (`index` and
# `loss_reduction`, the layer's error change against round-to-nearest).
LayerProgress = LayerErrorReport


@dataclass
class QuantizeOutcome:
    scheme: QuantScheme
    algorithm: str
    config: dict[str, Any]
    # The checkpoint's state dict: in memory, or read from staged files when written (streamed).
    tensors: Mapping[str, torch.Tensor]
    quantized_modules: list[str]
    storage_dtype: torch.dtype
    layer_reports: list[LayerProgress] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    bytes_before: int = 0

    @property
    def bytes_after(self) -> int:
        return sum(tensor_nbytes(self.tensors, name) for name in self.tensors)

    def save(
        self,
        out: Path,
        *,
        source_dir: Path,
        report: dict[str, Any] | None = None,
        force: bool = False,
    ) -> Path:
        """Write this outcome as a checkpoint at `out` (atomically; see `save_checkpoint`),
        the tokenizer and generation files copied from `source_dir`."""
        return save_checkpoint(
            out,
            source_dir=source_dir,
            config=self.config,
            tensors=self.tensors,
            scheme=self.scheme,
            algorithm=self.algorithm,
            quantized_modules=self.quantized_modules,
            report={**(report or {}), **self.experts_report()},
            force=force,
        )

    def experts_report(self) -> dict[str, Any]:
        """Mixture of experts, calibrated: per layer, the calibration tokens routed to each
        expert and the experts that got none and were rounded to nearest (empty otherwise)."""
        layers = [
            {"layer": r.index, "tokens": r.expert_tokens, "rtn_fallback": r.rtn_experts}
            for r in self.layer_reports
            if r.expert_tokens
        ]
        return {"moe_calibration": layers} if layers else {}

    def dense_state(self) -> dict[str, torch.Tensor]:
        """fp32 dense weights equal to what the checkpoint computes with (stored scales)."""
        loaded = LoadedCheckpoint(
            Path("."), self.config, self.scheme, dict(self.tensors), self.quantized_modules, None
        )
        dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
        return {k: v.float() if v.is_floating_point() else v for k, v in dense.items()}

    def runtime_model(self) -> CausalLM:
        """The model as the checkpoint runs it: `QuantLinear`s on the stored tensors, so what
        only happens at run time (W8A8's per-token activation quantization) is included."""
        tensors = dict(self.tensors)  # read once when streamed
        loaded = LoadedCheckpoint(
            Path("."), self.config, self.scheme, tensors, self.quantized_modules, None
        )
        modules: dict[str, torch.nn.Module] = {}
        for name in self.quantized_modules:
            local = loaded.module_tensors(name)
            bias = local.pop("bias", None)
            modules[name] = QuantLinear.from_tensors(local, scheme=self.scheme, bias=bias)
        return build_model(self.config, tensors, modules=modules)


def storage_dtype(config: dict[str, Any]) -> torch.dtype:
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return DTYPES.get(name, torch.float32)


def load_dense(model_dir: Path) -> tuple[dict[str, Any], CausalLM, int]:
    """(config, fp32 model, bytes of the source weights)."""
    config = read_config(model_dir)
    check_layer_count(model_dir, config)  # before gigabytes are read for a config that is wrong
    state = load_state_dict(model_dir)
    size = sum(t.numel() * t.element_size() for t in state.values())
    return config, build_model(config, state, dtype=torch.float32), size


def is_quantized_weight(key: str, modules: Container[str]) -> bool:
    """Whether `key` is the dense `weight` of a Linear the checkpoint stores quantized (its
    format's tensors stand in its place; an FP8 Linear's own `weight` is one of them)."""
    module, _, local = key.rpartition(".")
    return local == "weight" and module in modules


def dense_tensors(
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    quantized: Container[str],
    *,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The checkpoint's dense tensors from a state dict (names given `prefix`): all but the
    quantized Linears' weights, floating ones in the storage `dtype`, in the state's order."""
    return {
        prefix + key: value.to(dtype) if value.is_floating_point() else value
        for key, value in state.items()
        if not is_quantized_weight(prefix + key, quantized)
    }


def quantized_linears(model: CausalLM) -> list[tuple[str, int]]:
    """(module name, in_features) of every Linear the scheme quantizes: the family's Linears of
    each decoder layer and every expert's (embeddings, lm_head and MoE routers stay dense)."""
    return [
        (f"model.layers.{i}.{name}", layer.get_submodule(name).in_features)
        for i, layer in enumerate(model.model.layers)
        for name in model.config.layer_linears()
    ]


def quantize_model(
    model_dir: Path,
    *,
    scheme: QuantScheme,
    algorithm: str = "rtn",
    samples: Callable[[], torch.Tensor] | None = None,
    awq: AwqConfig | None = None,
    gptq: GptqConfig | None = None,
    smoothquant: SmoothQuantConfig | None = None,
    on_layer: Callable[[LayerProgress], None] | None = None,
    on_loaded: Callable[[CausalLM], None] | None = None,
    quantize_head: bool = False,
) -> QuantizeOutcome:
    """Quantize the model in `model_dir` to `scheme` with `algorithm` (rtn, awq or gptq; see
    `quantkit.quantize.algorithms`). A calibrated algorithm needs `samples`, a callable giving
    the calibration token matrix [n, seq_len], called after the model is loaded.

    `quantize_head`: the lm_head is rounded to nearest in the same scheme and stored as its own
    quantized Linear (untied from the embedding, which stays dense for lookups)."""
    method = algorithm_for(algorithm, scheme)  # before any work: a bad pairing fails at once
    if method.calibrated and samples is None:
        raise ValueError(f"{method.name} needs calibration samples")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    config, model, size = load_dense(model_dir)
    timings["load_s"] = time.perf_counter() - t0
    layers = quantized_linears(model)
    head = [("lm_head", model.lm_head.in_features)] if quantize_head else []
    # Before any long work: a bad group size fails at once (the head's input size included).
    scheme = scheme.resolve(layers + head)
    if on_loaded is not None:
        on_loaded(model)
    dtype = storage_dtype(config)
    t0 = time.perf_counter()
    ids = None
    if method.calibrated:
        assert samples is not None
        ids = samples()
        timings["calibration_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    job = QuantizeJob(model, model.family, scheme, dtype, samples=ids)
    job.awq = awq or job.awq
    job.gptq = gptq or job.gptq
    job.smoothquant = smoothquant or job.smoothquant
    module_tensors, reports = run_walk(method.walk(job), model.model.layers, on_layer)
    if quantize_head:
        w = model.lm_head.weight.detach()
        module_tensors["lm_head"] = scheme.format.round_and_store(w, scheme, dtype=dtype)
    timings["quantize_s"] = time.perf_counter() - t0
    tensors = dense_tensors(model.state_dict(), dtype, module_tensors)
    if quantize_head or config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, local in module_tensors.items():
        for suffix, t in local.items():
            tensors[f"{name}.{suffix}"] = t
    if quantize_head:
        config = {**config, "tie_word_embeddings": False}
    return QuantizeOutcome(
        scheme=scheme,
        algorithm=method.name,
        config=config,
        tensors=tensors,
        quantized_modules=[name for name, _ in layers + head],
        storage_dtype=dtype,
        layer_reports=reports,
        timings=timings,
        bytes_before=size,
    )
