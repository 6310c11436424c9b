"""Qwen3: a Llama layer without biases whose q and k are RMS-normed per head (`q_norm`,
`k_norm`, weights [head_dim]) before rope. AWQ's scale groups are Llama's: the per-head norms
sit after q/k_proj, so scaling their input columns leaves them unchanged."""

from __future__ import annotations

from dataclasses import replace

from quantkit.models.llama import ATTENTION_LINEARS, LLAMA, LLAMA_DECODE, MLP_LINEARS

assert LLAMA.gguf is not None
# llama.cpp's qwen3: Llama's tensor names plus the per-head norms; its rope rotates halves (NEOX),
# as transformers' does, so no rows are permuted.
QWEN3_GGUF = replace(
    LLAMA.gguf,
    architectures=("qwen3",),
    model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    layer={
        **LLAMA.gguf.layer,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    rope_permuted={},
)

QWEN3 = replace(
    LLAMA,
    model_types=("qwen3",),
    norms={
        "input_layernorm": "hidden",
        "post_attention_layernorm": "hidden",
        "self_attn.q_norm": "head_dim",
        "self_attn.k_norm": "head_dim",
    },
    bias_flags={"attention_bias": ATTENTION_LINEARS, "mlp_bias": MLP_LINEARS},
    qk_norm=True,
    decode=replace(LLAMA_DECODE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    gguf=QWEN3_GGUF,
)
