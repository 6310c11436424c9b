"""Phi-3: a Llama layer whose checkpoint stores q/k/v as one `self_attn.qkv_proj` (q, k, v rows
in that order) and gate/up as one `mlp.gate_up_proj` (gate rows first), and whose attention is a
sliding window over every layer when config.json sets `sliding_window` (as transformers'
Phi-3 does; Phi-3-mini-4k: 2047).

The quantized Linears are the stored ones, so the checkpoint names match the hub's and
transformers / vLLM load it. AWQ folds into a Linear's *last* rows when the group is narrower
than that Linear's output (AutoAWQ's rule): down_proj's scales into gate_up_proj's up rows, and
o_proj's (no GQA) into qkv_proj's v rows.
"""

from __future__ import annotations

from dataclasses import replace

from quantkit.models.family import DecodeLayout, ScaleGroup
from quantkit.models.llama import LLAMA, O_PROJ
from quantkit.models.mistral import all_sliding_if_window

QKV_PROJ, GATE_UP_PROJ, DOWN_PROJ = "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"

PHI3 = replace(
    LLAMA,
    model_types=("phi3",),
    linears=(QKV_PROJ, O_PROJ, GATE_UP_PROJ, DOWN_PROJ),
    linear_dims={
        QKV_PROJ: ("qkv", "hidden"),
        O_PROJ: ("hidden", "q"),
        GATE_UP_PROJ: ("gate_up", "hidden"),
        DOWN_PROJ: ("hidden", "intermediate"),
    },
    scale_groups=(
        ScaleGroup("input_layernorm", (QKV_PROJ,), "self_attn"),
        ScaleGroup("post_attention_layernorm", (GATE_UP_PROJ,), "mlp"),
        ScaleGroup(GATE_UP_PROJ, (DOWN_PROJ,), DOWN_PROJ),
    ),
    input_groups=((QKV_PROJ,), (O_PROJ,), (GATE_UP_PROJ,), (DOWN_PROJ,)),
    fused=(),
    decode=DecodeLayout(
        qkv=QKV_PROJ,
        o=O_PROJ,
        gate_up=GATE_UP_PROJ,
        down=DOWN_PROJ,
        in_norm="input_layernorm",
        post_norm="post_attention_layernorm",
        attention="self_attn",
    ),
    gguf=None,
    bias_flags=None,
    packed=True,
    default_layer_types=all_sliding_if_window,
    v_to_o=ScaleGroup(QKV_PROJ, (O_PROJ,), O_PROJ),
    no_clip=(QKV_PROJ,),
)
