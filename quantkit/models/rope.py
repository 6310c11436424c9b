"""Rotary embedding settings read from config.json, one `Rope` per attention layer type.

config.json spells them three ways: `rope_theta` + `rope_scaling` (transformers < 5),
`rope_parameters` (transformers >= 5: `rope_theta` and the scaling in one dict), and
`rope_parameters` keyed by layer type (Gemma 3: local layers rotate at 10k, global ones at 1M,
and only the global ones are scaled). Every spelling is read; a rule quantkit does not implement
raises an error naming the field, never a silently different forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.errors import ModelSourceError

# The scaling rules implemented (`rope_type`): what Llama 3.x and Gemma 3 ship with.
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Rope:
    """One rotary table's settings: base `theta`, `factor` (linear position interpolation:
    frequencies / factor), and Llama 3's piecewise rule (`llama3`: factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings)."""

    theta: float
    factor: float = 1.0
    llama3: tuple[float, float, float, float] | None = None

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """The [head_dim / 2] rotation frequencies (fp32), as the HF reference computes them."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.factor != 1.0:
            inv = inv / self.factor
        if self.llama3 is not None:
            inv = _llama3(inv, *self.llama3)
        return inv


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, old: float) -> torch.Tensor:
    """Llama 3.1's rule (transformers' `_compute_llama3_parameters`, same op order): long
    wavelengths slowed by `factor`, short ones kept, the band between interpolated."""
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _number(params: Mapping[str, Any], key: str, field: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelSourceError(f"config.json {field}.{key}: expected a number, got {value!r}")
    return float(value)


def _parse(params: Mapping[str, Any], theta: float, field: str) -> Rope:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ModelSourceError(
            f"config.json {field}.rope_type: expected one of {', '.join(ROPE_TYPES)}, got {kind!r}"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ModelSourceError(
            f"config.json {field}.partial_rotary_factor: expected 1.0, got {partial!r}"
        )
    theta = float(params.get("rope_theta", theta))
    if kind == "linear":
        return Rope(theta, factor=_number(params, "factor", field))
    if kind == "llama3":
        l3 = tuple(_number(params, key, field) for key in LLAMA3_KEYS)
        return Rope(theta, llama3=l3)  # type: ignore[arg-type]
    return Rope(theta)


def rope_for(config: Mapping[str, Any], layer_type: str, *, theta: float = 10000.0) -> Rope:
    """The Rope of layers of `layer_type` ("full_attention", "sliding_attention") in this
    config.json; `theta` is the family's default base when config.json names none."""
    if config.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelSourceError(
            "config.json partial_rotary_factor: expected 1.0, "
            f"got {config['partial_rotary_factor']!r}"
        )
    theta = float(config.get("rope_theta") or theta)
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        if layer_type not in params:  # keyed by layer type (Gemma 3)
            raise ModelSourceError(
                f"config.json rope_parameters: expected an entry for {layer_type!r}, "
                f"got {sorted(params)}"
            )
        return _parse(params[layer_type], theta, f"rope_parameters.{layer_type}")
    scaling = config.get("rope_scaling")
    if scaling:
        return _parse({**params, **scaling}, theta, "rope_scaling")
    return _parse(params, theta, "rope_parameters")
