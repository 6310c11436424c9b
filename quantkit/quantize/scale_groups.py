"""Per-channel scales folded into the op before a group of Linears: what AWQ and SmoothQuant
share.

A scale group (`models.family.ScaleGroup`) is a module `prev` (a norm, or a Linear) whose output
is the input of some Linears (and of dense modules such as a MoE router). Dividing prev's output
by a per-input-channel s and multiplying those modules' input columns by s leaves the layer's
function unchanged while moving magnitude between the activations and the weights: AWQ
searches s to protect the weights that meet large activations (`awq.py`), SmoothQuant sets it
to move activation outliers into the weights, where per-channel scales absorb them
(`smoothquant.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.decoder import CausalLM
from quantkit.models.family import Family, ScaleGroup
from quantkit.quantize.moe import moe_scale_groups


def model_scale_groups(model: CausalLM, arch: Family) -> list[ScaleGroup]:
    """The family's scale groups, v -> o without grouped-query attention (each v output
    column then feeds one o input), then the experts'."""
    groups = list(arch.scale_groups)
    if arch.v_to_o is not None and model.config.num_kv_heads == model.config.num_heads:
        groups.insert(1, arch.v_to_o)
    groups += moe_scale_groups(model)
    return groups


def fold_scale(layer: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """prev output / s, linears' input columns * s: the layer computes the same function."""
    prev = layer.get_submodule(group.prev)
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            # A Linear wider than the group (Phi-3's gate_up_proj before down_proj, qkv_proj
            # before o_proj) feeds it from its last rows (up, v): only those are scaled.
            rows = slice(prev.out_features - s.numel(), None)
            prev.weight[rows].div_(s.view(-1, 1))
            if prev.bias is not None:
                prev.bias[rows].div_(s)
        else:  # a norm: (1 + w) for Gemma, so the norm says how
            prev.divide_output_(s)
        for name in group.linears + group.dense:
            layer.get_submodule(name).weight.mul_(s.view(1, -1))
