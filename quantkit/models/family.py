"""What one model family's registry entry says (`Family`), and the pieces it is made of.

Everything family-specific lives in an entry: which Linears of a decoder layer are quantized,
the AWQ scale groups, the GPTQ input groups, which Linears run fused as one matmul, which carry
biases, the norms, the rope settings read from config.json, the GGUF tensor names, the layer
layout the C decode step reads, and the Linears' shapes for the roofline. The code that uses
them (decoder, fusion, fast path, AWQ/GPTQ, GGUF conversion, roofline) names no Linear itself.
Entries live in their own modules (`llama.py`, `qwen2.py`) and are registered in `families.py`.

Module names are relative to one decoder layer (`self_attn.q_proj`), as Hugging Face spells
them, so a checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from quantkit.models.rope import Rope, rope_for


@dataclass(frozen=True)
class ScaleGroup:
    """One AWQ scale group: a per-channel scale s folded into `prev` (its output divided by s,
    the Linears' input columns multiplied) leaves the layer's function unchanged."""

    prev: str  # a norm (scale its weight) or a Linear (scale its output rows)
    linears: tuple[str, ...]  # Linears sharing prev's output as input
    inspect: str  # module whose output the scale search compares ("self_attn", "mlp", ...)
    # The module whose input is prev's output, where the statistics are taken (default the
    # first Linear; a mixture-of-experts block, whose experts each see their tokens only).
    input: str | None = None
    # Linears reading prev's output that stay dense (a MoE router): their input columns are
    # multiplied by s too, unrounded, so the layer's function is unchanged.
    dense: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fusion:
    """Linears that read the same input and run as one matmul, their output rows concatenated
    in this order; the decoder reads the fused module from the attribute `into`."""

    into: str  # e.g. "self_attn.fused_qkv"
    linears: tuple[str, ...]


@dataclass(frozen=True)
class DecodeLayout:
    """One decoder layer as the C decode step (`fused_kernels.decode_cpu`) reads it: RMSNorm,
    fused q/k/v (q, k, v rows in that order), [per-head q/k RMSNorm], RoPE, attention, o,
    [RMSNorm of o's output], residual add, RMSNorm, fused gate/up (gate rows first), the gate's
    activation, down, [RMSNorm of down's output], residual add. The bracketed norms are named
    where a family has them. The window, rope tables, activation and attention scale/soft-cap
    are the model's config (`ModelConfig`). A family whose layer differs otherwise (a
    mixture of experts takes `moe` in place of gate_up / down) has no layout (`Family.decode`
    None)."""

    qkv: str  # a Fusion's `into`, or a Linear the checkpoint stores fused (Phi-3)
    o: str
    gate_up: str | None  # a Fusion's `into`, or a stored fused Linear; None with `moe`
    down: str | None
    in_norm: str
    post_norm: str  # the MLP's input norm
    attention: str  # the module holding the layer's KV cache (`cache`)
    q_norm: str | None = None  # Qwen3, Gemma 3
    k_norm: str | None = None
    attn_out_norm: str | None = None  # Gemma's sandwich norms
    ffn_out_norm: str | None = None
    # A mixture of experts in place of the MLP (`models.moe.SparseMoe`): its module, whose
    # router and experts the step runs (the top-k experts of each row only).
    moe: str | None = None


@dataclass(frozen=True)
class GgufNames:
    """How a llama.cpp GGUF of this family maps onto the Hugging Face layout."""

    architectures: tuple[str, ...]  # `general.architecture` values
    model_type: str  # written to the converted config.json
    hf_architecture: str  # its `architectures` entry, e.g. "LlamaForCausalLM"
    layer: Mapping[str, str]  # blk.N.<part> -> module name in decoder layer N
    globals: Mapping[str, str]  # tensor stem -> module name, e.g. token_embd -> model.embed_tokens
    # Parts whose rows llama.cpp permuted for its rotary layout -> the config.json key holding
    # their head count (undone by `sources.gguf.unpermute_qk`).
    rope_permuted: Mapping[str, str]
    # A mixture of experts' stacked tensors: blk.N.<part> -> the expert-local Linear it holds
    # for every expert of the layer's `Moe` block (llama.cpp's ffn_gate_exps is [experts, ...]).
    experts: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Moe:
    """A sparse mixture-of-experts block in place of the MLP (Mixtral, Qwen3-MoE): a router (a
    dense Linear hidden -> experts, never quantized) picks `top_k` experts per token; each
    expert is a SiLU-gated MLP whose Linears the checkpoint stores one by one, under the hub's
    names (`block.experts.E.gate`). The expert count and sizes come from config.json keys."""

    block: str  # the layer's attribute holding the block: "block_sparse_moe", "mlp"
    gate: str  # expert-local names of its gate, up and down Linears ("w1", "w3", "w2")
    up: str
    down: str
    # config.json keys of the number of experts, the first present is read (transformers 5
    # writes Qwen3-MoE's as num_local_experts, the hub's config.json says num_experts).
    experts_keys: tuple[str, ...]
    intermediate_key: str  # ... an expert's intermediate size
    # config.json flag: renormalize the top-k routing weights to sum 1 (None: always, Mixtral).
    renormalize_key: str | None
    # transformers' config-class defaults, used like transformers does when a key is absent.
    defaults: Mapping[str, Any]
    router: str = "gate"  # the router Linear, relative to `block`

    def expert(self, index: int, part: str) -> str:
        """Layer-relative name of expert `index`'s Linear `part` (one of gate, up, down)."""
        return f"{self.block}.experts.{index}.{getattr(self, part)}"

    def expert_linears(self, experts: int) -> tuple[str, ...]:
        """Every expert Linear of one layer, in forward order (expert by expert)."""
        return tuple(self.expert(e, p) for e in range(experts) for p in ("gate", "up", "down"))


# The dimensions a Linear's shape is given in (`Family.linear_dims`); see `shape_dims`.
# qkv and gate_up are the sizes of projections a family's checkpoint stores fused (Phi-3).
SHAPE_DIMS = ("hidden", "intermediate", "q", "kv", "head_dim", "qkv", "gate_up")


def shape_dims(
    *, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, int]:
    """The values of `SHAPE_DIMS` for one model: q = heads x head_dim, kv = kv_heads x head_dim,
    qkv = q + 2 kv, gate_up = 2 x intermediate."""
    return {
        "hidden": hidden,
        "intermediate": intermediate,
        "q": heads * head_dim,
        "kv": kv_heads * head_dim,
        "head_dim": head_dim,
        "qkv": (heads + 2 * kv_heads) * head_dim,
        "gate_up": 2 * intermediate,
    }


@dataclass(frozen=True, eq=False)  # entries are singletons: equal when identical
class Family:
    model_types: tuple[str, ...]  # config.json model_type values
    linears: tuple[str, ...]  # quantized Linears of one decoder layer, in forward order
    linear_dims: Mapping[str, tuple[str, str]]  # Linear -> (out, in) in `SHAPE_DIMS`
    norms: Mapping[str, str]  # a layer's norms -> their size in `SHAPE_DIMS`
    scale_groups: tuple[ScaleGroup, ...]
    # Linears that read the same input tensor, in the order the forward pass reaches them
    # (GPTQ: one Hessian per group, and each group sees the already-quantized earlier ones).
    input_groups: tuple[tuple[str, ...], ...]
    fused: tuple[Fusion, ...]
    decode: DecodeLayout | None  # None: the C decode step cannot run this family
    gguf: GgufNames | None  # None: no GGUF conversion
    # Linears that always carry a bias, and config flags that add biases to more of them
    # (Llama's attention_bias: q/k/v/o; Qwen2 has q/k/v biases and no flag).
    biases: tuple[str, ...] = ()
    bias_flags: Mapping[str, tuple[str, ...]] | None = None
    norm: str = "rmsnorm"  # the decoder's norm kind (`decoder.NORMS`)
    # The Rope of one layer type ("full_attention", "sliding_attention") in a config.json.
    rope: Callable[[Mapping[str, Any], str], Rope] = rope_for
    # The layer types when config.json lists none (`layer_types`): all full attention, or
    # (Mistral) all sliding when `sliding_window` is set.
    default_layer_types: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    # Per-head RMSNorm of q and k before rope (`self_attn.q_norm`, `self_attn.k_norm`).
    qk_norm: bool = False
    # Gemma's layer: the attention and MLP outputs are normed before the residual add
    # (post_attention_layernorm, post_feedforward_layernorm) and the MLP input by
    # pre_feedforward_layernorm; embeddings are multiplied by sqrt(hidden).
    sandwich_norms: bool = False
    embed_scale: bool = False
    # The checkpoint stores q/k/v as one `self_attn.qkv_proj` and gate/up as one
    # `mlp.gate_up_proj` (Phi-3); the decoder splits their outputs.
    packed: bool = False
    # Why the C decode step cannot run this family (when `decode` is None), in one line.
    pytorch_reason: str = ""
    attention: str = "self_attn"  # the module that mixes tokens (takes cos/sin, a cache)
    # v_proj -> o_proj folding only works when v's outputs map 1:1 onto o's inputs, i.e. no
    # grouped-query attention; with GQA one v channel feeds several heads' o columns.
    v_to_o: ScaleGroup | None = None
    # Linears whose clipping is not searched: q/k feed a softmax through a dot product, where
    # clipping error is amplified (same choice as the reference AWQ).
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    # A mixture-of-experts block in place of the MLP; `linears`, `scale_groups`,
    # `input_groups` then name the attention's alone and the experts' are added per model
    # (`ModelConfig.layer_linears`), since their count is the config's.
    moe: Moe | None = None

    @property
    def name(self) -> str:
        return self.model_types[0]

    def biased(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The Linears of one layer that carry a bias for this config.json, in forward order."""
        out = set(self.biases)
        for flag, linears in (self.bias_flags or {}).items():
            if config.get(flag):
                out.update(linears)
        return tuple(n for n in self.linears if n in out)


def layer_part(layer: Any, name: str) -> Any:
    """`layer.self_attn.fused_qkv` for name "self_attn.fused_qkv": like `get_submodule`, but it
    also reaches attributes that are not registered submodules (a fused matmul, None)."""
    return reduce(getattr, name.split("."), layer)
