"""Mistral: a Llama layer whose attention is a sliding window over every layer when
config.json sets `sliding_window` (Mistral 7B v0.1: 4096; v0.3: null, plain Llama)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from quantkit.models.llama import LLAMA


def all_sliding_if_window(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Every layer sliding when `sliding_window` is set, else every layer full (transformers'
    Mistral and Phi-3 read `sliding_window` alone; they have no `layer_types`)."""
    kind = "full_attention" if config.get("sliding_window") is None else "sliding_attention"
    return (kind,) * int(config.get("num_hidden_layers") or 0)


MISTRAL = replace(
    LLAMA,
    model_types=("mistral",),
    gguf=None,
    default_layer_types=all_sliding_if_window,
)
