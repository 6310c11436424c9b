"""The quantization algorithms, one registry entry each.

An algorithm chooses the codes; the format (`QuantScheme`) says how they are stored. Each entry
says which formats it can produce, whether it needs calibration text (and how much by default),
and the function that quantizes every decoder Linear of a loaded model. The pipeline looks the
algorithm up once and calls it; a new algorithm is one function plus one entry here.

| algorithm | formats | calibration | what it does |
|---|---|---|---|
| rtn  | every format | none | round to nearest on min/max (int4) or absmax (fp8) scales |
| awq  | int4      | 64 x 512 tokens | activation-aware scales folded into the previous op |
| gptq | int4, fp8 | 128 x 512 tokens | error-compensated rounding on RTN's scales, layer by layer |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.errors import SchemeError
from quantkit.format.formats import FORMATS
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family
from quantkit.quantize.awq import AwqConfig, awq_quantize
from quantkit.quantize.gptq import GptqConfig, gptq_quantize
from quantkit.quantize.layer_walk import LayerErrorReport

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
    """Everything an algorithm needs: the dense model (changed in place), its family entry, the
    resolved format, the Linears to quantize and the dtype their scales are stored in."""

    model: CausalLM
    arch: Family
    scheme: QuantScheme
    layers: list[tuple[str, int]]  # (module name, in_features)
    storage_dtype: torch.dtype
    samples: torch.Tensor | None = None  # calibration token ids [n, seq_len]
    awq: AwqConfig = field(default_factory=AwqConfig)
    gptq: GptqConfig = field(default_factory=GptqConfig)
    on_layer: Callable[[LayerErrorReport], None] | None = None

    def weight(self, name: str) -> torch.Tensor:
        return self.model.get_submodule(name).weight.data


Run = Callable[[QuantizeJob], tuple[ModuleTensors, list[LayerErrorReport]]]


@dataclass(frozen=True)
class Algorithm:
    name: str
    only: tuple[str, ...] | None  # the QuantScheme kinds it can produce; None = every format
    calib_samples: int  # default calibration windows; 0 = needs no calibration text
    run: Run

    @property
    def calibrated(self) -> bool:
        return self.calib_samples > 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The formats it produces, read from the format registry when it takes them all."""
        return tuple(FORMATS) if self.only is None else self.only


def _rtn(job: QuantizeJob) -> tuple[ModuleTensors, list[LayerErrorReport]]:
    fmt, scheme = job.scheme.format, job.scheme
    out: ModuleTensors = {}
    for name, _ in job.layers:
        q = fmt.round_to_nearest(job.weight(name), scheme)
        out[name] = fmt.store(q, scheme, dtype=job.storage_dtype)
    return out, []


def _awq(job: QuantizeJob) -> tuple[ModuleTensors, list[LayerErrorReport]]:
    assert job.samples is not None
    weights, reports = awq_quantize(
        job.model, job.samples, scheme=job.scheme, arch=job.arch, cfg=job.awq, on_layer=job.on_layer
    )
    out = {n: q.tensors(scheme=job.scheme, dtype=job.storage_dtype) for n, q in weights.items()}
    return out, list(reports)


def _gptq(job: QuantizeJob) -> tuple[ModuleTensors, list[LayerErrorReport]]:
    assert job.samples is not None
    out, reports = gptq_quantize(
        job.model,
        job.samples,
        arch=job.arch,
        scheme=job.scheme,
        cfg=job.gptq,
        # The codes are chosen for the scales as the checkpoint stores them.
        scale_dtype=job.storage_dtype,
        on_layer=job.on_layer,
    )
    return out, list(reports)


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        # Every format rounds to nearest (`WeightFormat.round_to_nearest`).
        Algorithm("rtn", None, 0, _rtn),
        Algorithm("awq", ("int4",), DEFAULT_CALIB_SAMPLES, _awq),
        Algorithm("gptq", ("int4", "fp8"), GPTQ_CALIB_SAMPLES, _gptq),
    )
}
# What `quantkit quantize` uses when no --method is given; a format not listed gets rtn.
DEFAULT_ALGORITHM: dict[str, str] = {"int4": "awq", "fp8": "gptq"}


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
