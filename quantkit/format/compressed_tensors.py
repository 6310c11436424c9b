"""QuantScheme <-> compressed-tensors `quantization_config` (config.json), both directions.

The config is what vLLM, SGLang and transformers read, so it is written exactly as
compressed-tensors writes it, and read strictly: every field that quantkit cannot run is a
CheckpointError naming the field, the expected values and the value found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.scheme import INT_GROUP_SIZES, QuantScheme

INT_FORMAT = "pack-quantized"
FLOAT_FORMAT = "float-quantized"
# compressed-tensors' own inference names FP8 without activation quantization naive-quantized;
# the tensors are identical (same compressor class), so a checkpoint saying so reads the same.
_FLOAT_FORMATS = (FLOAT_FORMAT, "naive-quantized")
# W8A8: the activation scale is computed per token at run time, so nothing is stored for it.
DYNAMIC_TOKEN_ACTIVATIONS: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "strategy": "token",
    "group_size": None,
    "symmetric": True,
    "dynamic": True,
}


def scheme_to_quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    """The `quantization_config` of config.json for `scheme` (compressed-tensors' schema).

    The algorithm that chose the codes (rtn / awq / gptq) has no place in it; `quantkit.json`
    keeps it.
    """
    if not scheme.is_resolved:
        raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
    if scheme.kind == "int4":
        fmt = INT_FORMAT
        per_channel = scheme.group_size == -1
        weights = {
            "num_bits": 4,
            "type": "int",
            "strategy": "channel" if per_channel else "group",
            # compressed-tensors writes null, not -1, for the channel strategy.
            "group_size": None if per_channel else scheme.group_size,
            "symmetric": scheme.symmetric,
            "dynamic": False,
        }
        acts = None
    else:
        fmt = FLOAT_FORMAT
        weights = {
            "num_bits": 8,
            "type": "float",
            "strategy": "channel",
            "group_size": None,
            "symmetric": True,
            "dynamic": False,
        }
        acts = dict(DYNAMIC_TOKEN_ACTIVATIONS) if scheme.activations == "dynamic" else None
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
        "ignore": ["lm_head"],
        "config_groups": {"group_0": group},
        "kv_cache_scheme": None,
    }


def scheme_from_quantization_config(cfg: Mapping[str, Any]) -> QuantScheme:
    """The QuantScheme a `quantization_config` describes; anything quantkit cannot run is a
    CheckpointError naming the field."""
    _expect(cfg, "quant_method", ("compressed-tensors",))
    _expect(cfg, "quantization_status", ("compressed",))
    # A quantized KV cache stores k_scale/v_scale tensors quantkit neither checks nor uses.
    _expect(cfg, "kv_cache_scheme", (None,))
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        count = len(groups) if isinstance(groups, Mapping) else groups
        raise CheckpointError(
            f"quantization_config.config_groups: expected exactly one group, got {count!r}"
        )
    ((gname, group),) = groups.items()
    where = f"config_groups.{gname}"
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
    _expect(w, "dynamic", (False,), where=f"{where}.weights")
    if wtype == "int":
        return _int_scheme(w, fmt=fmt, acts=acts, where=where)
    if wtype == "float":
        return _float_scheme(w, fmt=fmt, acts=acts, where=where)
    raise CheckpointError(
        f"quantization_config.{where}.weights.type: expected 'int' or 'float', got {wtype!r}"
    )


def _int_scheme(w: Mapping[str, Any], *, fmt: Any, acts: Any, where: str) -> QuantScheme:
    if fmt != INT_FORMAT:
        raise CheckpointError(
            f"quantization_config.{where}.format: expected {INT_FORMAT!r} for int weights, "
            f"got {fmt!r}"
        )
    _expect(w, "num_bits", (4,), where=f"{where}.weights")
    _expect(w, "symmetric", (True, False), where=f"{where}.weights")
    strategy = _expect(w, "strategy", ("group", "channel"), where=f"{where}.weights")
    size = w.get("group_size")
    if strategy == "channel":
        _expect(w, "group_size", (None, -1), where=f"{where}.weights")
        group_size = -1
    else:
        _expect(
            w, "group_size", tuple(g for g in INT_GROUP_SIZES if g > 0), where=f"{where}.weights"
        )
        group_size = int(size)
    if acts is not None:
        raise CheckpointError(
            f"quantization_config.{where}.input_activations: expected null for int4 weights "
            f"(W4A16), got {acts!r}"
        )
    return QuantScheme("int4", group_size=group_size, symmetric=bool(w["symmetric"]))


def _float_scheme(w: Mapping[str, Any], *, fmt: Any, acts: Any, where: str) -> QuantScheme:
    if fmt not in _FLOAT_FORMATS:
        raise CheckpointError(
            f"quantization_config.{where}.format: expected {FLOAT_FORMAT!r} for float weights, "
            f"got {fmt!r}"
        )
    _expect(w, "num_bits", (8,), where=f"{where}.weights")
    _expect(w, "strategy", ("channel",), where=f"{where}.weights")
    _expect(w, "symmetric", (True,), where=f"{where}.weights")
    if acts is None:
        activations = "none"
    else:
        if not isinstance(acts, Mapping):
            raise CheckpointError(
                f"quantization_config.{where}.input_activations: expected null or a dict, "
                f"got {acts!r}"
            )
        for key, want in DYNAMIC_TOKEN_ACTIVATIONS.items():
            if key != "group_size":
                _expect(acts, key, (want,), where=f"{where}.input_activations")
        activations = "dynamic"
    return QuantScheme("fp8", activations=activations)


def _expect(cfg: Mapping[str, Any], key: str, allowed: tuple[Any, ...], *, where: str = "") -> Any:
    """cfg[key], which must be one of `allowed` (compared with its type: True is not 1)."""
    value = cfg.get(key)
    if not any(type(value) is type(a) and value == a for a in allowed):
        field = f"quantization_config.{where + '.' if where else ''}{key}"
        wanted = " or ".join(repr(a) for a in allowed)
        raise CheckpointError(f"{field}: expected {wanted}, got {value!r}")
    return value
