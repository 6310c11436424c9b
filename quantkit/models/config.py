"""config.json -> `ModelConfig`: the decoder's settings, its family's entry looked up once.

Every field the forward depends on is read here and checked: a missing required field, or an
option quantkit does not implement (a rope rule, an activation, a layer type), fails in one line
naming the field, so no model runs a silently different forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from quantkit.errors import ModelSourceError
from quantkit.models.families import family_for
from quantkit.models.family import Family
from quantkit.models.layers import ACTIVATIONS
from quantkit.models.rope import Rope

LAYER_TYPES = ("full_attention", "sliding_attention")


def required_int(cfg: Mapping[str, Any], key: str) -> int:
    """A positive integer config.json must carry, or an error naming it."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelSourceError(
            f"config.json {key}: expected a positive integer, got {value!r}"
            + (" (field missing)" if key not in cfg else "")
        )
    return value


def _optional_float(cfg: Mapping[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelSourceError(f"config.json {key}: expected a positive number, got {value!r}")
    return float(value)


def _layer_types(cfg: Mapping[str, Any], family: Family, layers: int) -> tuple[str, ...]:
    listed = cfg.get("layer_types")
    if listed is None:
        if family.default_layer_types is not None:
            return family.default_layer_types(cfg)[:layers]
        return ("full_attention",) * layers
    types = tuple(listed)
    bad = [t for t in types if t not in LAYER_TYPES]
    if len(types) != layers or bad:
        raise ModelSourceError(
            f"config.json layer_types: expected {layers} of {', '.join(LAYER_TYPES)}, "
            f"got {len(types)} ({', '.join(map(repr, bad)) or 'all known'})"
        )
    return types


def _activation(cfg: Mapping[str, Any]) -> str:
    key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    name = cfg.get(key) or "silu"
    if name not in ACTIVATIONS:
        raise ModelSourceError(
            f"config.json {key}: expected one of {', '.join(ACTIVATIONS)}, got {name!r}"
        )
    return str(name)


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts layer's sizes, read from config.json (`Family.moe` names the keys)."""

    experts: int
    top_k: int  # experts per token
    intermediate: int  # an expert's intermediate size
    renormalize: bool  # top-k routing weights rescaled to sum 1


def moe_config(cfg: Mapping[str, Any], family: Family) -> MoeConfig | None:
    """The experts' sizes for a mixture-of-experts family (None for a dense one), checked."""
    moe = family.moe
    if moe is None:
        return None
    merged = {**moe.defaults, **{k: v for k, v in cfg.items() if v is not None}}
    key = next((k for k in moe.experts_keys if k in cfg), moe.experts_keys[0])
    experts = required_int(merged, key)
    top_k = required_int(merged, "num_experts_per_tok")
    if top_k > experts:
        raise ModelSourceError(
            f"config.json num_experts_per_tok: expected at most {key} = {experts}, got {top_k}"
        )
    # Qwen3-MoE's dense layers among the sparse ones: none in any released checkpoint.
    dense_layers = cfg.get("mlp_only_layers") or []
    step = cfg.get("decoder_sparse_step", 1)
    if dense_layers or step != 1:
        key = "mlp_only_layers" if dense_layers else "decoder_sparse_step"
        raise ModelSourceError(
            f"config.json {key}: expected every layer sparse (mlp_only_layers [], "
            f"decoder_sparse_step 1), got {cfg.get(key)!r}"
        )
    renormalize = True if moe.renormalize_key is None else bool(merged[moe.renormalize_key])
    return MoeConfig(experts, top_k, required_int(merged, moe.intermediate_key), renormalize)


@dataclass(frozen=True)
class ModelConfig:
    family: Family  # the registry entry, looked up once here
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    ropes: tuple[Rope, ...]  # the distinct rotary tables
    rope_index: tuple[int, ...]  # per layer: its table in `ropes`
    layer_types: tuple[str, ...]  # per layer: full_attention or sliding_attention
    sliding_window: int | None  # the window of sliding_attention layers
    activation: str  # the MLP's (`layers.ACTIVATIONS`)
    attn_scale: float | None  # q k^T scale; None: head_dim ** -0.5
    attn_softcap: float | None  # Gemma 2: cap * tanh(logits / cap) on attention logits
    final_softcap: float | None  # ... and on the output logits
    max_position_embeddings: int
    tie_word_embeddings: bool
    biases: tuple[str, ...]  # the Linears of a layer that carry a bias
    moe: MoeConfig | None = None  # the experts, for a family with a mixture-of-experts block

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        family = family_for(cfg)  # raises for unsupported families
        heads = required_int(cfg, "num_attention_heads")
        hidden = required_int(cfg, "hidden_size")
        layers = required_int(cfg, "num_hidden_layers")
        types = _layer_types(cfg, family, layers)
        window = None
        if "sliding_attention" in types:
            window = required_int(cfg, "sliding_window")
        by_type = {t: family.rope(cfg, t) for t in LAYER_TYPES if t in types}
        ropes = tuple(dict.fromkeys(by_type.values()))
        scalar = _optional_float(cfg, "query_pre_attn_scalar")
        return cls(
            family=family,
            model_type=str(cfg["model_type"]),
            hidden_size=hidden,
            intermediate_size=required_int(cfg, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=required_int(cfg, "vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            ropes=ropes,
            rope_index=tuple(ropes.index(by_type[t]) for t in types),
            layer_types=types,
            sliding_window=window,
            activation=_activation(cfg),
            attn_scale=None if scalar is None else scalar**-0.5,
            attn_softcap=_optional_float(cfg, "attn_logit_softcapping"),
            final_softcap=_optional_float(cfg, "final_logit_softcapping"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            biases=family.biased(cfg),
            moe=moe_config(cfg, family),
        )

    @property
    def rope(self) -> Rope:
        """Layer 0's rope (every layer's, but for Gemma 3's two)."""
        return self.ropes[self.rope_index[0]]

    def linear(self, name: str, n: int, k: int) -> nn.Linear:
        """The layer's Linear `name` [n, k], with a bias where the family puts one."""
        return nn.Linear(k, n, bias=name in self.biases)

    def layer_linears(self) -> tuple[str, ...]:
        """The quantized Linears of one decoder layer, in forward order: the family's, then
        (mixture of experts) every expert's gate, up and down, expert by expert."""
        if self.family.moe is None or self.moe is None:
            return self.family.linears
        return self.family.linears + self.family.moe.expert_linears(self.moe.experts)

    def pytorch_only(self) -> str | None:
        """Why the C decode step cannot run this model whatever its weights, or None."""
        if self.family.decode is None:
            return f"family {self.family.name}: {self.family.pytorch_reason or 'no C layout'}"
        return None

    def window_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")
