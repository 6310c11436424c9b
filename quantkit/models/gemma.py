"""Gemma 2 and Gemma 3 (text): RMSNorm computing x * (1 + w); embeddings times sqrt(hidden);
a GeGLU MLP (`gelu_pytorch_tanh`); four norms a layer, the attention and MLP outputs normed
before each residual add; q k^T scaled by `query_pre_attn_scalar` ** -0.5 (not head_dim); and
sliding-window layers alternating with global ones (`layer_types`). Gemma 2 soft-caps the
attention and output logits; Gemma 3 instead RMS-norms q and k per head, and its local layers
rotate with their own rope (`rope_parameters` keyed by layer type, or the older
`rope_local_base_freq`).

AWQ's MLP group hangs off `pre_feedforward_layernorm` (post_attention_layernorm norms the
attention's output, not the MLP's input); folding into a (1 + w) norm is
`GemmaRMSNorm.divide_output_`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from quantkit.models.family import ScaleGroup
from quantkit.models.llama import (
    DOWN_PROJ,
    GATE_PROJ,
    K_PROJ,
    LLAMA,
    LLAMA_DECODE,
    O_PROJ,
    Q_PROJ,
    UP_PROJ,
    V_PROJ,
)
from quantkit.models.rope import Rope, rope_for

GEMMA_NORMS = {
    "input_layernorm": "hidden",
    "post_attention_layernorm": "hidden",
    "pre_feedforward_layernorm": "hidden",
    "post_feedforward_layernorm": "hidden",
}


def gemma3_rope(config: Mapping[str, Any], layer_type: str) -> Rope:
    """Gemma 3's ropes: `rope_parameters` keyed by layer type (transformers >= 5), or the
    older spelling, `rope_theta` + `rope_scaling` for global layers and
    `rope_local_base_freq` (unscaled) for the sliding ones."""
    params = config.get("rope_parameters") or {}
    if layer_type == "sliding_attention" and layer_type not in params:
        return rope_for({}, layer_type, theta=float(config.get("rope_local_base_freq", 10000.0)))
    return rope_for(config, layer_type, theta=1_000_000.0)


# The C step's layer: the MLP's input norm is pre_feedforward_layernorm, and the attention's and
# the MLP's outputs are normed before each residual add.
GEMMA_DECODE = replace(
    LLAMA_DECODE,
    post_norm="pre_feedforward_layernorm",
    attn_out_norm="post_attention_layernorm",
    ffn_out_norm="post_feedforward_layernorm",
)

GEMMA2 = replace(
    LLAMA,
    model_types=("gemma2",),
    norms=GEMMA_NORMS,
    scale_groups=(
        ScaleGroup("input_layernorm", (Q_PROJ, K_PROJ, V_PROJ), "self_attn"),
        ScaleGroup("pre_feedforward_layernorm", (GATE_PROJ, UP_PROJ), "mlp"),
        ScaleGroup(UP_PROJ, (DOWN_PROJ,), DOWN_PROJ),
    ),
    decode=GEMMA_DECODE,
    gguf=None,
    norm="gemma_rmsnorm",
    sandwich_norms=True,
    embed_scale=True,
    v_to_o=ScaleGroup(V_PROJ, (O_PROJ,), O_PROJ),
)

GEMMA3_TEXT = replace(
    GEMMA2,
    model_types=("gemma3_text",),
    norms={**GEMMA_NORMS, "self_attn.q_norm": "head_dim", "self_attn.k_norm": "head_dim"},
    qk_norm=True,
    decode=replace(GEMMA_DECODE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    rope=gemma3_rope,
)
