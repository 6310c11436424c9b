"""The Llama family (Llama 1-3.x, with Llama 3's rope scaling; SmolLM): the entry the others
start from (`dataclasses.replace(LLAMA, ...)`)."""

from __future__ import annotations

from quantkit.models.family import DecodeLayout, Family, Fusion, GgufNames, ScaleGroup

Q_PROJ, K_PROJ, V_PROJ = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
O_PROJ = "self_attn.o_proj"
GATE_PROJ, UP_PROJ, DOWN_PROJ = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
ATTENTION_LINEARS = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ)
MLP_LINEARS = (GATE_PROJ, UP_PROJ, DOWN_PROJ)

# The C decode step's view of a Llama layer, which the other dense families' layouts extend.
LLAMA_DECODE = DecodeLayout(
    qkv="self_attn.fused_qkv",
    o=O_PROJ,
    gate_up="mlp.fused_gate_up",
    down=DOWN_PROJ,
    in_norm="input_layernorm",
    post_norm="post_attention_layernorm",
    attention="self_attn",
)

LLAMA = Family(
    model_types=("llama",),
    linears=(Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ),
    linear_dims={
        Q_PROJ: ("q", "hidden"),
        K_PROJ: ("kv", "hidden"),
        V_PROJ: ("kv", "hidden"),
        O_PROJ: ("hidden", "q"),
        GATE_PROJ: ("intermediate", "hidden"),
        UP_PROJ: ("intermediate", "hidden"),
        DOWN_PROJ: ("hidden", "intermediate"),
    },
    norms={"input_layernorm": "hidden", "post_attention_layernorm": "hidden"},
    scale_groups=(
        ScaleGroup("input_layernorm", (Q_PROJ, K_PROJ, V_PROJ), "self_attn"),
        ScaleGroup("post_attention_layernorm", (GATE_PROJ, UP_PROJ), "mlp"),
        ScaleGroup(UP_PROJ, (DOWN_PROJ,), DOWN_PROJ),
    ),
    input_groups=((Q_PROJ, K_PROJ, V_PROJ), (O_PROJ,), (GATE_PROJ, UP_PROJ), (DOWN_PROJ,)),
    fused=(
        Fusion("self_attn.fused_qkv", (Q_PROJ, K_PROJ, V_PROJ)),
        Fusion("mlp.fused_gate_up", (GATE_PROJ, UP_PROJ)),
    ),
    decode=LLAMA_DECODE,
    gguf=GgufNames(
        architectures=("llama",),
        model_type="llama",
        hf_architecture="LlamaForCausalLM",
        layer={
            "attn_q": Q_PROJ,
            "attn_k": K_PROJ,
            "attn_v": V_PROJ,
            "attn_output": O_PROJ,
            "ffn_gate": GATE_PROJ,
            "ffn_up": UP_PROJ,
            "ffn_down": DOWN_PROJ,
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        globals={
            "token_embd": "model.embed_tokens",
            "output_norm": "model.norm",
            "output": "lm_head",
        },
        rope_permuted={"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"},
    ),
    bias_flags={"attention_bias": ATTENTION_LINEARS, "mlp_bias": MLP_LINEARS},
    v_to_o=ScaleGroup(V_PROJ, (O_PROJ,), O_PROJ),
)
