"""QuantScheme <-> compressed-tensors `quantization_config` (config.json), both directions.

The config is what vLLM, SGLang and transformers read, so it is written exactly as
compressed-tensors writes it, and read strictly: every field that quantkit cannot run is a
CheckpointError naming the field, the expected values and the value found. The envelope (one
config group targeting Linear, compressed, no KV-cache scheme) is here; each format's `weights`
and `input_activations` entries are its own (`quantkit.format.formats`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.formats import FORMATS
from quantkit.format.scheme import QuantScheme
from quantkit.format.weight_format import expect


def scheme_to_quantization_config(
    scheme: QuantScheme, *, quantized_head: bool = False
) -> dict[str, Any]:
    """The `quantization_config` of config.json for `scheme` (compressed-tensors' schema);
    `quantized_head`: lm_head is stored in the scheme too, not dense.

    The algorithm that chose the codes (rtn / awq / gptq) has no place in it; `quantkit.json`
    keeps it.
    """
    if not scheme.is_resolved:
        raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
    fmt = scheme.format.ct_formats[0]
    weights, acts = scheme.format.config_entries(scheme)
    group = {
        "targets": ["Linear"],
        "format": fmt,
        "weights": weights,
        "input_activations": acts,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        # Required: without it loaders treat the weights as not yet compressed (NaN or failure).
        "quantization_status": "compressed",
        # Required whenever lm_head is stored dense ("Linear" would otherwise target it).
        "ignore": [] if quantized_head else ["lm_head"],
        "config_groups": {"group_0": group},
        "kv_cache_scheme": None,
    }


def scheme_from_quantization_config(cfg: Mapping[str, Any]) -> QuantScheme:
    """The QuantScheme a `quantization_config` describes; anything quantkit cannot run is a
    CheckpointError naming the field."""
    if not isinstance(cfg, Mapping):
        raise CheckpointError(
            f"quantization_config: expected an object, got {type(cfg).__name__} {cfg!r:.60}"
        )
    expect(cfg, "quant_method", ("compressed-tensors",))
    expect(cfg, "quantization_status", ("compressed",))
    # A quantized KV cache stores k_scale/v_scale tensors quantkit neither checks nor uses.
    expect(cfg, "kv_cache_scheme", (None,))
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        count = len(groups) if isinstance(groups, Mapping) else groups
        raise CheckpointError(
            f"quantization_config.config_groups: expected exactly one group, got {count!r}"
        )
    ((gname, group),) = groups.items()
    where = f"config_groups.{gname}"
    if not isinstance(group, Mapping):
        raise CheckpointError(
            f"quantization_config.{where}: expected an object, got {type(group).__name__}"
        )
    targets = group.get("targets")
    if not isinstance(targets, list) or "Linear" not in targets:
        raise CheckpointError(
            f"quantization_config.{where}.targets: expected a list with 'Linear', got {targets!r}"
        )
    fmt = group.get("format") or cfg.get("format")
    if cfg.get("format") is not None and fmt != cfg.get("format"):
        raise CheckpointError(
            f"quantization_config.{where}.format: expected the top-level format "
            f"{cfg.get('format')!r}, got {fmt!r}"
        )
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise CheckpointError(f"quantization_config.{where}.weights: expected a dict, got {w!r}")
    acts = group.get("input_activations")
    if group.get("output_activations") is not None:
        raise CheckpointError(
            f"quantization_config.{where}.output_activations: expected null, "
            f"got {group['output_activations']!r}"
        )
    wtype = w.get("type")
    expect(w, "dynamic", (False,), where=f"{where}.weights")
    candidates = [f for f in FORMATS.values() if f.ct_type == wtype]
    if not candidates:
        types = dict.fromkeys(f.ct_type for f in FORMATS.values())
        raise CheckpointError(
            f"quantization_config.{where}.weights.type: expected "
            f"{' or '.join(repr(t) for t in types)}, got {wtype!r}"
        )
    # One format per weight type reads (and names) every field itself; with several, the one
    # whose width and config format both match, else the one the format names (its error then
    # names the width), else num_bits picks, else the first one's error.
    bits = w.get("num_bits")
    rules = (
        lambda f: bits == f.bits and fmt in f.ct_formats,
        lambda f: fmt in f.ct_formats,
        lambda f: bits == f.bits,
    )
    chosen = next((f for rule in rules for f in candidates if rule(f)), candidates[0])
    return QuantScheme(**chosen.scheme_fields(w, fmt=fmt, acts=acts, where=where))
