"""Architecture knowledge, in one table.

For each supported family: which Linears in a decoder layer are quantized, which of them share
an input (GPTQ), and the AWQ scale groups: (the op whose output feeds the group, the Linears
that read it, the module whose output the search compares). Folding a per-channel scale s into
the "previous op" keeps the layer mathematically unchanged: prev's output is divided by s, the
Linears' input columns multiplied.
Everything outside this file is architecture-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import ModelSourceError


@dataclass(frozen=True)
class ScaleGroup:
    """One AWQ scale group inside a decoder layer (module names relative to the layer)."""

    prev: str  # an RMSNorm (scale its weight) or a Linear (scale its output rows)
    linears: tuple[str, ...]  # Linears sharing prev's output as input
    inspect: str  # module whose output the scale search compares ("self_attn", "mlp", ...)


@dataclass(frozen=True)
class Arch:
    families: tuple[str, ...]  # config.json model_type values
    linears: tuple[str, ...]  # quantized Linears of one decoder layer
    scale_groups: tuple[ScaleGroup, ...]
    # Linears that read the same input tensor, in the order the forward pass reaches them
    # (GPTQ: one Hessian per group, and each group sees the already-quantized earlier ones).
    input_groups: tuple[tuple[str, ...], ...]
    # v_proj -> o_proj folding only works when v's outputs map 1:1 onto o's inputs, i.e. no
    # grouped-query attention; with GQA one v channel feeds several heads' o columns.
    v_to_o: ScaleGroup | None = None
    # Linears whose clipping is not searched: q/k feed a softmax through a dot product, where
    # clipping error is amplified (same choice as the reference AWQ).
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")


LLAMA_FAMILY = Arch(
    families=("llama", "mistral", "qwen2"),
    linears=(
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ),
    scale_groups=(
        ScaleGroup(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
        ),
        ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    input_groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    v_to_o=ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
)

ARCHITECTURES: tuple[Arch, ...] = (LLAMA_FAMILY,)
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(f for a in ARCHITECTURES for f in a.families)


def arch_for(config: dict) -> Arch:
    """The Arch entry for an HF config.json, or an error listing what is supported."""
    family = config.get("model_type")
    for arch in ARCHITECTURES:
        if family in arch.families:
            return arch
    raise ModelSourceError(
        f"unsupported architecture: expected model_type one of {', '.join(SUPPORTED_FAMILIES)} "
        f"(SmolLM is llama), got {family!r}"
    )
