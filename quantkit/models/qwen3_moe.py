"""Qwen3-MoE: a Qwen3 layer (per-head q/k RMSNorm) whose MLP is a sparse mixture of experts
(`mlp`): a router `mlp.gate` picks `num_experts_per_tok` of `num_experts` experts per token
(softmax, top-k, renormalized only with `norm_topk_prob`); expert E is stored as
`mlp.experts.E.gate_proj` / `up_proj` / `down_proj` [moe_intermediate_size]. No shared expert
(Qwen2-MoE has one; Qwen3-MoE dropped it). Layers listed in `mlp_only_layers`, or skipped by
`decoder_sparse_step`, would be dense MLPs: no released Qwen3-MoE has any, and quantkit refuses
such a config (`ModelConfig`)."""

from __future__ import annotations

from dataclasses import replace

from quantkit.models.family import Moe
from quantkit.models.llama import ATTENTION_LINEARS
from quantkit.models.mixtral import ATTENTION_ONLY, MOE_DECODE
from quantkit.models.qwen3 import QWEN3, QWEN3_GGUF

# llama.cpp's qwen3moe: the router as ffn_gate_inp, each layer's experts stacked per Linear.
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
QWEN3_MOE_GGUF = replace(
    QWEN3_GGUF,
    architectures=("qwen3moe",),
    model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    layer={
        **{k: v for k, v in QWEN3_GGUF.layer.items() if k not in _DENSE_MLP},
        "ffn_gate_inp": "mlp.gate",
    },
    experts={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
)

QWEN3_MOE = replace(
    QWEN3,
    model_types=("qwen3_moe",),
    **{
        **ATTENTION_ONLY,
        "gguf": QWEN3_MOE_GGUF,
        "decode": replace(
            MOE_DECODE, moe="mlp", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"
        ),
    },
    bias_flags={"attention_bias": ATTENTION_LINEARS},  # experts carry no bias
    moe=Moe(
        block="mlp",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        experts_keys=("num_experts", "num_local_experts"),
        intermediate_key="moe_intermediate_size",
        renormalize_key="norm_topk_prob",
        defaults={
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": False,
        },
    ),
)
