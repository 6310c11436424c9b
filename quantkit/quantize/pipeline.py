"""Quantize a model end to end: load, calibrate, RTN / AWQ / FP8 (nearest or GPTQ rounding),
build the checkpoint tensors.

The CLI adds evaluation and writes the checkpoint; this module knows nothing about either, so
tests and scripts can call it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.format.checkpoint import LoadedCheckpoint, dequantize_checkpoint_tensors
from quantkit.format.packing import int4_dequantize, int4_quantize, quantize_fp8
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import fp8_tensors, int4_tensors
from quantkit.models.decoder import CausalLM, build_model
from quantkit.models.families import arch_for
from quantkit.quantize.awq import AwqConfig, LayerReport, awq_quantize
from quantkit.quantize.gptq import GptqConfig, GptqLayerReport, gptq_quantize_fp8
from quantkit.quantize.rtn import Int4Weights, group_size_for, rtn_quantize_weight
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.sources.resolve import load_state_dict, read_config

# Calibration windows for the activation statistics (x 512 tokens). See cli/quantize_cmd.py.
DEFAULT_CALIB_SAMPLES = 64
# GPTQ's Hessians gain from more tokens: SmolLM2-135M FP8 perplexity (reference 20.848, RTN
# 21.119) was 20.954-20.978 with 64 windows and 20.934-20.942 with 128, at 2x the time (~4.5 min
# on 2 cores); evals/gptq_quality.py.
GPTQ_CALIB_SAMPLES = 128
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a layer-by-layer quantizer reports after each decoder layer (both have `index` and
# `loss_reduction`, the layer's error change against round-to-nearest).
LayerProgress = LayerReport | GptqLayerReport


@dataclass(frozen=True)
class CalibrationSpec:
    """Where calibration text comes from and how much of it the statistics use."""

    path: Path | None = None  # None: the bundled Wikipedia articles (calibration split)
    n_samples: int = DEFAULT_CALIB_SAMPLES
    seq_len: int = 512
    seed: int = 0


@dataclass
class QuantizeOutcome:
    scheme: QuantScheme
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # the checkpoint's state dict
    quantized_modules: list[str]
    storage_dtype: torch.dtype
    layer_reports: list[LayerProgress] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    bytes_before: int = 0

    @property
    def bytes_after(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dense_state(self) -> dict[str, torch.Tensor]:
        """fp32 dense weights equal to what the checkpoint computes with (stored scales)."""
        loaded = LoadedCheckpoint(
            Path("."), self.config, self.scheme, self.tensors, self.quantized_modules, None
        )
        dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
        return {k: v.float() if v.is_floating_point() else v for k, v in dense.items()}

    def runtime_model(self) -> CausalLM:
        """The model as the checkpoint runs it: `QuantLinear`s on the stored tensors, so what
        only happens at run time (W8A8's per-token activation quantization) is included."""
        loaded = LoadedCheckpoint(
            Path("."), self.config, self.scheme, self.tensors, self.quantized_modules, None
        )
        modules: dict[str, torch.nn.Module] = {}
        for name in self.quantized_modules:
            local = loaded.module_tensors(name)
            bias = local.pop("bias", None)
            modules[name] = QuantLinear.from_tensors(local, scheme=self.scheme, bias=bias)
        return build_model(self.config, self.tensors, modules=modules)


def storage_dtype(config: dict[str, Any]) -> torch.dtype:
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return _DTYPES.get(name, torch.float32)


def load_dense(model_dir: Path) -> tuple[dict[str, Any], CausalLM, int]:
    """(config, fp32 model, bytes of the source weights)."""
    config = read_config(model_dir)
    state = load_state_dict(model_dir)
    size = sum(t.numel() * t.element_size() for t in state.values())
    return config, build_model(config, state, dtype=torch.float32), size


def quantized_linears(model: CausalLM, config: dict[str, Any]) -> list[tuple[str, int]]:
    """(module name, in_features) of every Linear the scheme quantizes (decoder layers only;
    embeddings and lm_head stay dense)."""
    arch = arch_for(config)
    return [
        (f"model.layers.{i}.{name}", layer.get_submodule(name).in_features)
        for i, layer in enumerate(model.model.layers)
        for name in arch.linears
    ]


def _calibration(
    samples: Callable[[], torch.Tensor] | None,
    what: str,
    timings: dict[str, float],
    *,
    since: float,
) -> torch.Tensor:
    """The calibration token matrix, its making timed into timings["calibration_s"]."""
    if samples is None:
        raise ValueError(f"{what} needs calibration samples")
    ids = samples()
    timings["calibration_s"] = time.perf_counter() - since
    return ids


def quantize_model(
    model_dir: Path,
    *,
    scheme: QuantScheme,
    samples: Callable[[], torch.Tensor] | None = None,
    awq: AwqConfig | None = None,
    gptq: GptqConfig | None = None,
    on_layer: Callable[[LayerProgress], None] | None = None,
    on_loaded: Callable[[CausalLM], None] | None = None,
) -> QuantizeOutcome:
    """Quantize the model in `model_dir` with `scheme` (AWQ and GPTQ rounding need `samples`, a
    callable giving the calibration token matrix [n, seq_len], called after the model is
    loaded)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    config, model, size = load_dense(model_dir)
    timings["load_s"] = time.perf_counter() - t0
    layers = quantized_linears(model, config)
    scheme = scheme.resolve(layers)  # before any long work: a bad group size fails at once
    if on_loaded is not None:
        on_loaded(model)
    dtype = storage_dtype(config)
    reports: list[LayerProgress] = []
    t0 = time.perf_counter()
    module_tensors: dict[str, dict[str, torch.Tensor]] = {}
    if scheme.method == "fp8" and scheme.rounding == "gptq":
        ids = _calibration(samples, "gptq rounding", timings, since=t0)
        t0 = time.perf_counter()
        fp8_weights, gptq_reports = gptq_quantize_fp8(
            model,
            ids,
            arch=arch_for(config),
            cfg=gptq or GptqConfig(),
            scale_dtype=dtype,  # the codes are chosen for the scale as the checkpoint stores it
            on_layer=on_layer,
        )
        reports = list(gptq_reports)
        for name, (w8, scale) in fp8_weights.items():
            module_tensors[name] = fp8_tensors(w8, scale, dtype=dtype)
    elif scheme.method == "fp8":
        # No calibration: a per-output-channel absmax scale is all E4M3 needs.
        for name, _ in layers:
            w8, scale = quantize_fp8(model.get_submodule(name).weight.data)
            module_tensors[name] = fp8_tensors(w8, scale, dtype=dtype)
    else:
        weights: dict[str, Int4Weights]
        if scheme.method == "awq":
            ids = _calibration(samples, "awq", timings, since=t0)
            t0 = time.perf_counter()
            weights, awq_reports = awq_quantize(
                model,
                ids,
                scheme=scheme,
                arch=arch_for(config),
                cfg=awq or AwqConfig(),
                on_layer=on_layer,
            )
            reports = list(awq_reports)
        else:
            weights = {
                name: rtn_quantize_weight(model.get_submodule(name).weight.data, scheme=scheme)
                for name, _ in layers
            }
        for name, q in weights.items():
            # Codes were chosen for fp32 scales; re-derive them for the scale as stored, so the
            # checkpoint's weights are the best this storage dtype allows.
            scale = q.scale.to(dtype).float()
            g = group_size_for(scheme, q.codes.shape[1])
            w = int4_dequantize(q.codes, q.scale, q.zero, group_size=g)
            codes = int4_quantize(w, scale, q.zero, group_size=g)
            module_tensors[name] = int4_tensors(codes, scale, q.zero, dtype=dtype)
    timings["quantize_s"] = time.perf_counter() - t0
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        module = key.rpartition(".")[0]
        if module in module_tensors and key.endswith(".weight"):
            continue
        if key == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        tensors[key] = value.to(dtype) if value.is_floating_point() else value
    for name, local in module_tensors.items():
        for suffix, t in local.items():
            tensors[f"{name}.{suffix}"] = t
    return QuantizeOutcome(
        scheme=scheme,
        config=config,
        tensors=tensors,
        quantized_modules=[name for name, _ in layers],
        storage_dtype=dtype,
        layer_reports=reports,
        timings=timings,
        bytes_before=size,
    )
