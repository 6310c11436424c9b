"""Mixtral: a Mistral layer whose MLP is a sparse mixture of experts (`block_sparse_moe`): a
router `gate` [experts, hidden] picks `num_experts_per_tok` of `num_local_experts` experts per
token (softmax, top-k, renormalized to sum 1); expert E is a SiLU-gated MLP stored as
`block_sparse_moe.experts.E.w1` (gate), `w3` (up) and `w2` (down), the hub's names.

The family's own Linears are the attention's; the experts' are added per model (their count is
config.json's). AWQ and GPTQ treat the experts in `quantize/moe.py`.
"""

from __future__ import annotations

from dataclasses import replace

from quantkit.models.family import Fusion, Moe, ScaleGroup
from quantkit.models.llama import (
    ATTENTION_LINEARS,
    K_PROJ,
    LLAMA_DECODE,
    O_PROJ,
    Q_PROJ,
    V_PROJ,
)
from quantkit.models.mistral import MISTRAL

ATTENTION_ONLY = {
    "linears": ATTENTION_LINEARS,
    "linear_dims": {
        Q_PROJ: ("q", "hidden"),
        K_PROJ: ("kv", "hidden"),
        V_PROJ: ("kv", "hidden"),
        O_PROJ: ("hidden", "q"),
    },
    "scale_groups": (ScaleGroup("input_layernorm", (Q_PROJ, K_PROJ, V_PROJ), "self_attn"),),
    "input_groups": ((Q_PROJ, K_PROJ, V_PROJ), (O_PROJ,)),
    "fused": (Fusion("self_attn.fused_qkv", (Q_PROJ, K_PROJ, V_PROJ)),),
    "decode": None,
    "gguf": None,
}

# The C step's layer: the MoE block `block_sparse_moe` in place of the MLP.
MOE_DECODE = replace(LLAMA_DECODE, gate_up=None, down=None, moe="block_sparse_moe")

MIXTRAL = replace(
    MISTRAL,
    model_types=("mixtral",),
    **{**ATTENTION_ONLY, "decode": MOE_DECODE},
    bias_flags=None,
    moe=Moe(
        block="block_sparse_moe",
        gate="w1",
        up="w3",
        down="w2",
        experts_keys=("num_local_experts",),
        intermediate_key="intermediate_size",
        renormalize_key=None,
        defaults={"num_local_experts": 8, "num_experts_per_tok": 2},
    ),
)
