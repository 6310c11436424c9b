"""What AWQ and GPTQ do differently for a mixture-of-experts layer (Mixtral, Qwen3-MoE).

Each expert's Linears are quantized like any other, calibrated on the tokens the router sends
to that expert (the decoder calls an expert on its routed tokens only, so the capture hooks see
exactly those). The router stays dense.

- AWQ: one scale group from the post-attention norm to every expert's gate and up (the norm's
  output feeds them all, and the router, whose columns absorb the same scale unrounded),
  searched on the whole block's output over all tokens; then per expert, up -> down, a scale
  from the mean |x| of that expert's routed down-projection inputs, searched on them.
- GPTQ: per expert, a Hessian of its routed gate/up inputs and one of its down inputs.
- An expert the calibration text never reaches has no statistics: it is rounded to nearest
  (AWQ: no up -> down scale and no clip search; GPTQ: RTN on the same scales), and the layer's
  report lists it (`LayerErrorReport.rtn_experts`) with every expert's token count.
"""

from __future__ import annotations

from collections.abc import Callable

from quantkit.models.decoder import CausalLM
from quantkit.models.family import ScaleGroup


def expert_linears(model: CausalLM) -> frozenset[str]:
    """The layer-relative names of every expert Linear (empty for a dense family)."""
    return frozenset(model.config.layer_linears()) - frozenset(model.family.linears)


def moe_scale_groups(model: CausalLM) -> list[ScaleGroup]:
    """AWQ's groups for the experts (none for a dense family); see the module docstring."""
    moe, sizes = model.family.moe, model.config.moe
    if moe is None or sizes is None:
        return []
    experts = range(sizes.experts)
    shared = ScaleGroup(
        "post_attention_layernorm",
        tuple(moe.expert(e, p) for e in experts for p in ("gate", "up")),
        moe.block,
        input=moe.block,
        dense=(f"{moe.block}.{moe.router}",),
    )
    down = [
        ScaleGroup(moe.expert(e, "up"), (moe.expert(e, "down"),), moe.expert(e, "down"))
        for e in experts
    ]
    return [shared, *down]


def moe_input_groups(model: CausalLM) -> list[tuple[str, ...]]:
    """GPTQ's input groups for the experts, in forward order: (gate, up), (down) per expert."""
    moe, sizes = model.family.moe, model.config.moe
    if moe is None or sizes is None:
        return []
    groups: list[tuple[str, ...]] = []
    for e in range(sizes.experts):
        groups += [(moe.expert(e, "gate"), moe.expert(e, "up")), (moe.expert(e, "down"),)]
    return groups


def expert_token_counts(model: CausalLM, tokens_into: Callable[[str], int]) -> list[int]:
    """Calibration tokens routed to each expert: what its gate Linear saw (`tokens_into`)."""
    moe, sizes = model.family.moe, model.config.moe
    if moe is None or sizes is None:
        return []
    return [tokens_into(moe.expert(e, "gate")) for e in range(sizes.experts)]


def expert_of(model: CausalLM, name: str) -> int | None:
    """The expert index of a layer-relative Linear name, or None for a non-expert one."""
    moe = model.family.moe
    prefix = None if moe is None else f"{moe.block}.experts."
    if prefix is None or not name.startswith(prefix):
        return None
    return int(name.removeprefix(prefix).split(".", 1)[0])
