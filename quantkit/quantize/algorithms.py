"""The quantization algorithms, one registry entry each.

An algorithm chooses the codes; the format (`QuantScheme`) says how they are stored. Each entry
says which formats it can produce, whether it needs calibration text (and how much by default),
and its walk: a step that quantizes one decoder layer at a time (`layer_walk.LayerWalk`), which
the in-memory and the streaming pipelines drive alike. A new algorithm is one walk plus one entry
here.

| algorithm | formats | calibration | what it does |
|---|---|---|---|
| rtn  | every format | none | round to nearest on min/max (int4) or absmax (fp8) scales |
| awq  | int4      | 64 x 512 tokens | activation-aware scales folded into the previous op |
| gptq | int4, fp8, int8, nvfp4, mxfp4 | 128 x 512 | error-compensated rounding on RTN's scales |
| awq+gptq | int4    | 128 x 512 tokens | AWQ's scales folded, then GPTQ on clipped scales |
| smoothquant | int8 | 64 x 512 tokens | activation outliers folded into the weights, then rtn |
| smoothquant+gptq | int8 | 128 x 512 tokens | SmoothQuant's folds, then GPTQ's rounding |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.errors import SchemeError
from quantkit.format.formats import FORMATS
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family
from quantkit.quantize.awq import AwqConfig, awq_walk
from quantkit.quantize.awq_gptq import awq_gptq_walk
from quantkit.quantize.gptq import GptqConfig, gptq_walk
from quantkit.quantize.layer_walk import LayerErrorReport, LayerWalk
from quantkit.quantize.moe import moe_input_groups
from quantkit.quantize.smoothquant import SmoothQuantConfig, smoothquant_walk
from quantkit.quantize.smoothquant_gptq import smoothquant_gptq_walk

# Calibration windows (x 512 tokens) for the activation statistics. 64, not AWQ's 128: on
# SmolLM2-135M, 64 samples closed 56-57% of the RTN gap on every seed measured while 128 gave
# 13-55% (evals/studies/awq_quality.py), and it halves the time.
DEFAULT_CALIB_SAMPLES = 64
# GPTQ's Hessians gain from more tokens: SmolLM2-135M FP8 perplexity (reference 20.848, RTN
# 21.119) was 20.954-20.978 with 64 windows and 20.934-20.942 with 128, at 2x the time (~4.5 min
# on 2 cores); evals/studies/gptq_quality.py.
GPTQ_CALIB_SAMPLES = 128

ModuleTensors = dict[str, dict[str, torch.Tensor]]  # module name -> its checkpoint tensors


@dataclass
class QuantizeJob:
    """Everything an algorithm needs: the model (its embedding, rotary tables and config; the
    decoder layers come to the walk's step one at a time), its family entry, the resolved
    format and the dtype the scales are stored in."""

    model: CausalLM
    arch: Family
    scheme: QuantScheme
    storage_dtype: torch.dtype
    samples: torch.Tensor | None = None  # calibration token ids [n, seq_len]
    awq: AwqConfig = field(default_factory=AwqConfig)
    gptq: GptqConfig = field(default_factory=GptqConfig)
    smoothquant: SmoothQuantConfig = field(default_factory=SmoothQuantConfig)


# job -> the walk whose step returns the layer's checkpoint tensors (`ModuleTensors`).
Walk = Callable[[QuantizeJob], LayerWalk]


@dataclass(frozen=True)
class Algorithm:
    name: str
    only: tuple[str, ...] | None  # the QuantScheme kinds it can produce; None = every format
    calib_samples: int  # default calibration windows; 0 = needs no calibration text
    walk: Walk
    configs: tuple[str, ...] = ()  # the settings of the job it reads: "awq", "gptq"

    @property
    def calibrated(self) -> bool:
        return self.calib_samples > 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The formats it produces, read from the format registry when it takes them all."""
        return tuple(FORMATS) if self.only is None else self.only


def _rtn(job: QuantizeJob) -> LayerWalk:
    fmt, scheme, linears = job.scheme.format, job.scheme, job.model.config.layer_linears()
    # Linears that read one input are rounded together (`round_and_store_group`: NVFP4 gives
    # them one global scale, as vLLM's fused q/k/v and gate/up need); the rest one by one.
    groups = [
        g
        for g in (*job.arch.input_groups, *moe_input_groups(job.model))
        if all(n in linears for n in g)
    ]
    grouped = {n for g in groups for n in g}
    groups += [(n,) for n in linears if n not in grouped]

    def step(index: int, layer: nn.Module, x: torch.Tensor | None) -> tuple:
        rounded: dict[str, dict[str, torch.Tensor]] = {}
        for group in groups:
            weights = [layer.get_submodule(n).weight.data for n in group]
            stored = fmt.round_and_store_group(weights, scheme, dtype=job.storage_dtype)
            rounded.update(zip(group, stored, strict=True))
        out: ModuleTensors = {f"model.layers.{index}.{n}": rounded[n] for n in linears}
        return out, LayerErrorReport(index), None

    return LayerWalk(step)


def _awq(job: QuantizeJob) -> LayerWalk:
    assert job.samples is not None
    walk = awq_walk(job.model, job.samples, scheme=job.scheme, arch=job.arch, cfg=job.awq)

    def step(index: int, layer: nn.Module, x: torch.Tensor | None) -> tuple:
        weights, report, x = walk.step(index, layer, x)
        out = {n: q.tensors(scheme=job.scheme, dtype=job.storage_dtype) for n, q in weights.items()}
        return out, report, x

    return LayerWalk(step, walk.x)


def _gptq(job: QuantizeJob) -> LayerWalk:
    assert job.samples is not None
    # The codes are chosen for the scales as the checkpoint stores them.
    return gptq_walk(
        job.model,
        job.samples,
        arch=job.arch,
        scheme=job.scheme,
        cfg=job.gptq,
        scale_dtype=job.storage_dtype,
    )


def _awq_gptq(job: QuantizeJob) -> LayerWalk:
    assert job.samples is not None
    return awq_gptq_walk(
        job.model,
        job.samples,
        scheme=job.scheme,
        arch=job.arch,
        awq=job.awq,
        gptq=job.gptq,
        scale_dtype=job.storage_dtype,
    )


def _smoothquant(job: QuantizeJob) -> LayerWalk:
    assert job.samples is not None
    return smoothquant_walk(
        job.model,
        job.samples,
        scheme=job.scheme,
        arch=job.arch,
        cfg=job.smoothquant,
        scale_dtype=job.storage_dtype,
    )


def _smoothquant_gptq(job: QuantizeJob) -> LayerWalk:
    assert job.samples is not None
    return smoothquant_gptq_walk(
        job.model,
        job.samples,
        scheme=job.scheme,
        arch=job.arch,
        smoothquant=job.smoothquant,
        gptq=job.gptq,
        scale_dtype=job.storage_dtype,
    )


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        # Every format rounds to nearest (`WeightFormat.round_to_nearest`).
        Algorithm("rtn", None, 0, _rtn),
        Algorithm("awq", ("int4",), DEFAULT_CALIB_SAMPLES, _awq, ("awq",)),
        Algorithm(
            "gptq", ("int4", "fp8", "int8", "nvfp4", "mxfp4"), GPTQ_CALIB_SAMPLES, _gptq, ("gptq",)
        ),
        Algorithm("awq+gptq", ("int4",), GPTQ_CALIB_SAMPLES, _awq_gptq, ("awq", "gptq")),
        # Reads job.smoothquant, which the CLI leaves at SmoothQuantConfig's defaults.
        Algorithm("smoothquant", ("int8",), DEFAULT_CALIB_SAMPLES, _smoothquant),
        Algorithm("smoothquant+gptq", ("int8",), GPTQ_CALIB_SAMPLES, _smoothquant_gptq, ("gptq",)),
    )
}
# What `quantkit quantize` uses when no --method is given; a format not listed gets rtn. INT4:
# AWQ's scales, then GPTQ's rounding refined by 4 passes (`GptqConfig.refine`): on SmolLM2-135M
# it closes 68.6% of the RTN perplexity gap (8192 held-out tokens), AWQ alone 52.2%, and takes
# 681 s on 2 cores against AWQ's 388 s (README). INT8: on SmolLM2-135M W8A8
# (evals/studies/int8_quality.py, 8192 held-out tokens) SmoothQuant then GPTQ is +0.72%
# perplexity, SmoothQuant alone +1.43%, round to nearest +2.97%.
DEFAULT_ALGORITHM: dict[str, str] = {"int4": "awq+gptq", "fp8": "gptq", "int8": "smoothquant+gptq"}


def algorithm_for(name: str | None, scheme: QuantScheme) -> Algorithm:
    """The registry entry for `name` (None: the format's default); an algorithm that cannot
    produce the format is an error naming the ones that can."""
    name = DEFAULT_ALGORITHM.get(scheme.kind, "rtn") if name is None else name
    if name not in ALGORITHMS:
        raise SchemeError(f"method: expected one of {', '.join(ALGORITHMS)}, got {name!r}")
    algorithm = ALGORITHMS[name]
    if scheme.kind not in algorithm.kinds:
        able = [a.name for a in ALGORITHMS.values() if scheme.kind in a.kinds]
        raise SchemeError(
            f"method {name}: produces {' or '.join(algorithm.kinds)} only; for {scheme.kind} "
            f"expected one of {', '.join(able)}"
        )
    return algorithm
