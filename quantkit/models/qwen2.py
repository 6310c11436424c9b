"""Qwen2 / Qwen2.5: a Llama layer whose q/k/v always carry biases (its config.json has no
flag for them; `mlp_bias` is honoured as for Llama). No GGUF conversion yet."""

from __future__ import annotations

from dataclasses import replace

from quantkit.models.llama import K_PROJ, LLAMA, MLP_LINEARS, Q_PROJ, V_PROJ

QWEN2 = replace(
    LLAMA,
    model_types=("qwen2",),
    biases=(Q_PROJ, K_PROJ, V_PROJ),
    bias_flags={"mlp_bias": MLP_LINEARS},
    gguf=None,
)
