"""Quantize a model streamed from its files, one decoder layer at a time, resumably.

Per layer: build it in fp32 from its tensors (`source_model`), run the algorithm's step on it
(the same `LayerWalk` the in-memory pipeline drives, so the tensors are the same), write its
tensors to the staging directory with the activations leaving it (`staging`), free it. Then the
embedding, final norm and head. Peak memory is one layer in fp32, the calibration activations
and the algorithm's working set: it does not grow with the number of layers. The checkpoint is
then written from the staged files one shard at a time (`QuantizeOutcome.save`), and the
staging directory removed by the caller.

On a GPU (`device`), the layer being calibrated, the calibration activations, the embedding rows
they read and the rotary tables live on it; the layer's finished tensors and a copy of the
activations leaving it come back to the host to be staged. Everything else stays on the host
or on disk, as on the CPU, where `device` changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any

import torch
from torch import nn

from quantkit.format.checkpoint import FileTensors, check_module_tensors
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.algorithms import QuantizeJob, algorithm_for
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.layer_walk import LayerErrorReport
from quantkit.quantize.pipeline import (
    QuantizeOutcome,
    dense_tensors,
    is_quantized_weight,
    quantized_linears,
    storage_dtype,
)
from quantkit.quantize.source_model import EMBED, SourceModel
from quantkit.quantize.staging import Staging

OnLayer = Callable[[LayerErrorReport], None]


def stream_quantize(
    source: SourceModel,
    staging: Staging,
    *,
    scheme: QuantScheme,
    algorithm: str = "rtn",
    samples: Callable[[], torch.Tensor] | None = None,
    awq: AwqConfig | None = None,
    gptq: GptqConfig | None = None,
    on_layer: OnLayer | None = None,
    quantize_head: bool = False,
    resumed: int = 0,
    device: torch.device | str = "cpu",
) -> QuantizeOutcome:
    """Quantize `source` layer by layer into `staging` (opened by the caller; `resumed` is the
    number of layers it already holds, which are not redone). Returns the outcome, whose tensors
    are read from the staged files when the checkpoint is written."""
    method = algorithm_for(algorithm, scheme)
    if method.calibrated and samples is None:
        raise ValueError(f"{method.name} needs calibration samples")
    shell, timings = source.shell, {}
    layers = quantized_linears(shell)
    head = [("lm_head", shell.lm_head.in_features)] if quantize_head else []
    scheme = scheme.resolve(layers + head)
    dtype = storage_dtype(source.config)
    t0 = time.perf_counter()
    ids = None
    if method.calibrated:
        assert samples is not None
        ids = source.calibration_shell(samples())
        shell.model.embed_tokens.to(device)
        shell.model.rotary.to(device)
        timings["calibration_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    job = QuantizeJob(shell, shell.family, scheme, dtype, samples=ids)
    job.awq, job.gptq = awq or job.awq, gptq or job.gptq
    walk = method.walk(job)
    reports = [_report_from(staging.layers[i]["report"]) for i in range(resumed)]
    for report in reports:
        if on_layer is not None:
            on_layer(report)
    x = staging.activations().to(device) if resumed and method.calibrated else walk.x
    for index in range(resumed, source.num_layers):
        layer = source.layer(index).to(device)
        out, report, x = walk.step(index, layer, x)
        tensors = _layer_tensors(index, layer, out, scheme, dtype)
        del layer, out
        staging.save_layer(index, tensors, asdict(report), None if x is None else x.cpu())
        del tensors
        reports.append(report)
        if on_layer is not None:
            on_layer(report)
    for part, make in _outer_parts(source, scheme, dtype, quantize_head):
        if part not in staging.outer:
            staging.save_outer(part, make())
    timings["quantize_s"] = time.perf_counter() - t0
    modules = [name for name, _ in layers + head]
    config = {**source.config, "tie_word_embeddings": False} if quantize_head else source.config
    return QuantizeOutcome(
        scheme=scheme,
        algorithm=method.name,
        config=config,
        tensors=FileTensors(staging.files(), _checkpoint_order(source, staging, modules)),
        quantized_modules=modules,
        storage_dtype=dtype,
        layer_reports=reports,
        timings=timings,
        bytes_before=source.nbytes(),
    )


def _layer_tensors(
    index: int,
    layer: nn.Module,
    quantized: dict[str, dict[str, torch.Tensor]],
    scheme: QuantScheme,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The finished layer's checkpoint tensors in checkpoint order, on the host: its dense
    tensors (norms with any folded scales, biases, routers) in the storage dtype, then each
    quantized Linear's, checked against the format before anything is written."""
    prefix = f"model.layers.{index}."
    tensors = dense_tensors(layer.state_dict(), dtype, quantized, prefix=prefix)
    for name, local in quantized.items():
        check_module_tensors(local, scheme=scheme, prefix=name)
        for suffix, t in local.items():
            tensors[f"{name}.{suffix}"] = t
    return {name: t.cpu() for name, t in tensors.items()}


def _outer_parts(
    source: SourceModel, scheme: QuantScheme, dtype: torch.dtype, quantize_head: bool
) -> list[tuple[str, Callable[[], dict[str, torch.Tensor]]]]:
    """The tensors outside the decoder layers, each made (and written, and freed) in turn: the
    embedding, the final norm and the head (dense, its own when untied; or rounded to nearest
    in the scheme with `quantize_head`)."""

    def head() -> dict[str, torch.Tensor]:
        if not quantize_head:
            return {"lm_head.weight": source.read_as(source.head_source, dtype)}
        w = source.read_fp32(source.head_source)
        stored = scheme.format.round_and_store(w, scheme, dtype=dtype)
        return {f"lm_head.{suffix}": t for suffix, t in stored.items()}

    parts: list[tuple[str, Callable[[], dict[str, torch.Tensor]]]] = [
        ("embed", lambda: {EMBED: source.read_as(EMBED, dtype)}),
        ("norm", lambda: {"model.norm.weight": source.read_as("model.norm.weight", dtype)}),
    ]
    if quantize_head or not source.config.get("tie_word_embeddings"):
        parts.append(("head", head))
    return parts


def _checkpoint_order(source: SourceModel, staging: Staging, modules: list[str]) -> list[str]:
    """The tensors' order in the checkpoint: the dense ones in the model's state-dict order,
    then the quantized Linears' layer by layer, then a quantized head's (the order the
    in-memory pipeline writes, so shards split at the same places). An FP8 Linear's `weight`
    is a quantized tensor, not a dense one, though the dense model has the same name."""
    staged: list[str] = [n for i in sorted(staging.layers) for n in staging.layers[i]["names"]]
    staged += [n for names in staging.outer.values() for n in names]
    available, quantized = set(staged), set(modules)
    dense = [
        k
        for k in source.shell.state_dict()
        if k in available and not is_quantized_weight(k, quantized)
    ]
    taken = set(dense)
    return dense + [n for n in staged if n not in taken]


def _report_from(data: dict[str, Any]) -> LayerErrorReport:
    """A finished layer's report as the manifest kept it (the fields every algorithm has)."""
    names = {f.name for f in fields(LayerErrorReport)}
    return LayerErrorReport(**{k: v for k, v in data.items() if k in names})
