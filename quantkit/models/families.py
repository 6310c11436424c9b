"""The registry of model families: one entry each (`quantkit.models.family.Family`).

A new family is one entry (usually `dataclasses.replace` of an existing one, in its own module
under `quantkit/models/`) plus one line in `FAMILIES`. Look a family up once per model
(`family_for(config)`, done by `build_model`); everything downstream reads `model.family`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantkit.errors import ModelSourceError
from quantkit.models.family import DecodeLayout, Family, Fusion, GgufNames, Rope, ScaleGroup
from quantkit.models.gemma import GEMMA2, GEMMA3_TEXT
from quantkit.models.llama import LLAMA
from quantkit.models.mistral import MISTRAL
from quantkit.models.mixtral import MIXTRAL
from quantkit.models.phi3 import PHI3
from quantkit.models.qwen2 import QWEN2
from quantkit.models.qwen3 import QWEN3
from quantkit.models.qwen3_moe import QWEN3_MOE

__all__ = [
    "FAMILIES",
    "DecodeLayout",
    "Family",
    "Fusion",
    "GgufNames",
    "Rope",
    "ScaleGroup",
    "family_for",
    "gguf_architectures",
    "gguf_family",
    "supported_model_types",
]

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    PHI3,
    GEMMA2,
    GEMMA3_TEXT,
    MIXTRAL,
    QWEN3_MOE,
)


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_for(config: Mapping[str, Any]) -> Family:
    """The entry for an HF config.json, or an error listing what is supported."""
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ModelSourceError(
        "unsupported architecture: expected model_type one of "
        f"{', '.join(supported_model_types())} (SmolLM is llama), got {model_type!r}"
    )


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` values some family converts."""
    return tuple(a for f in FAMILIES if f.gguf is not None for a in f.gguf.architectures)


def gguf_family(architecture: str) -> Family | None:
    """The family converting GGUF files of `architecture`, if any."""
    for family in FAMILIES:
        if family.gguf is not None and architecture in family.gguf.architectures:
            return family
    return None
