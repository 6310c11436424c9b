"""The decoder of every registered family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, and the
mixture-of-experts Mixtral and Qwen3-MoE, whose block is `models/moe.py`), from config.json.

Module names follow Hugging Face's (`model.layers.3.self_attn.q_proj`, ...) so a checkpoint's
state dict loads without renaming. What differs between families (biases, norm kind, rope
settings) comes from the family's registry entry (`families.py`), looked up once per model and
carried as `CausalLM.family` for everything downstream (fusion, the C step, AWQ/GPTQ). Any
Linear may be a dense `nn.Linear` or a `QuantLinear`; the model does not care.

Shapes: B batch, T new tokens, S cache length, H hidden, Hq/Hkv heads, D head_dim.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import ModelSourceError
from quantkit.models.config import ModelConfig
from quantkit.models.family import Family
from quantkit.models.kv_cache import KVCache, kv_format
from quantkit.models.layers import (
    ACTIVATIONS,
    NORMS,
    Rotary,
    apply_rope,
    attend,
    window_mask,
)
from quantkit.models.moe import SparseMoe

__all__ = ["NORMS", "CausalLM", "FastPath", "KVCache", "ModelConfig", "build_model"]


def _eager_cpu(x: torch.Tensor) -> bool:
    """True when a data-dependent fast path may read tensor values on the host: a CPU tensor,
    outside torch.compile's tracing."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h, d, family = cfg.hidden_size, cfg.head_dim, cfg.family
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        if family.packed:
            self.qkv_proj = cfg.linear("self_attn.qkv_proj", q + 2 * kv, h)
        else:
            self.q_proj = cfg.linear("self_attn.q_proj", q, h)
            self.k_proj = cfg.linear("self_attn.k_proj", kv, h)
            self.v_proj = cfg.linear("self_attn.v_proj", kv, h)
        self.o_proj = cfg.linear("self_attn.o_proj", h, q)
        if family.qk_norm:
            self.q_norm = NORMS[family.norm](d, cfg.rms_norm_eps)
            self.k_norm = NORMS[family.norm](d, cfg.rms_norm_eps)
        self.qk_norm = family.qk_norm
        self.rope_index = cfg.rope_index[index]  # this layer's rotary table
        self.window = cfg.sliding_window if cfg.layer_types[index] == "sliding_attention" else None
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        self.cache: KVCache | None = None
        # A `quantkit.runtime.fusion.FusedLinear`, set by fuse_projections.
        self.fused_qkv: Any = None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, Hq, D] with RoPE not yet applied, k, v [B, T, Hkv, D]."""
        b, t, _ = x.shape
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        fused = self.fused_qkv
        if fused is not None and fused.valid():
            qkv = fused(x)
        elif hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj(x)
        else:
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            return q, k, v
        q, k, v = qkv.view(b, t, sum(heads), self.head_dim).split(heads, dim=2)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, H]; cos, sin [B, T, K, D] (this layer reads table `rope_index`). Without a
        cache: causal attention over x alone. With one: k/v are written at `positions` and
        queries attend to the cache under `mask` [B, 1, T, S]."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.shape[2] > 1:
            cos = cos[:, :, self.rope_index : self.rope_index + 1]
            sin = sin[:, :, self.rope_index : self.rope_index + 1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        plain = self.window is None and self.softcap is None
        how = {"scale": self.scale, "softcap": self.softcap}
        if self.cache is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.window is not None:
                pos = torch.arange(t, device=x.device).expand(b, t)
                sliding = window_mask(pos, t, self.window, None)
                out = attend(q, k, v, mask=sliding, causal=False, **how)
            else:
                out = attend(q, k, v, mask=None, causal=t > 1, **how)
        elif plain and b == 1 and positions is not None and _eager_cpu(x):
            # One row: its tokens sit at consecutive slots, and the query attends to the
            # slots up to its own only (not the whole cache under a mask).
            start = int(positions[0, 0])
            end = start + t
            keys, values = self.cache.write_span(start, k, v)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=t > 1 and start == 0,
                attn_mask=None if t == 1 or start == 0 else mask[..., :end], enable_gqa=True,
                scale=self.scale,
            )  # fmt: skip
        else:
            assert positions is not None and mask is not None
            keys, values = self.cache.update(positions, k, v)
            if self.window is not None:
                mask = window_mask(positions, keys.shape[2], self.window, mask)
            out = attend(q.transpose(1, 2), keys, values, mask=mask, causal=False, **how)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        if cfg.family.packed:
            self.gate_up_proj = cfg.linear("mlp.gate_up_proj", 2 * i, h)
        else:
            self.gate_proj = cfg.linear("mlp.gate_proj", i, h)
            self.up_proj = cfg.linear("mlp.up_proj", i, h)
        self.down_proj = cfg.linear("mlp.down_proj", h, i)
        self.act = ACTIVATIONS[cfg.activation]
        # A `quantkit.runtime.fusion.FusedLinear`, see fuse_projections.
        self.fused_gate_up: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        if fused is not None and fused.valid():
            gate, up = fused(x).chunk(2, dim=-1)
        elif hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        norm, h, eps = NORMS[cfg.family.norm], cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = norm(h, eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = norm(h, eps)
        self.sandwich = cfg.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(h, eps)
            self.post_feedforward_layernorm = norm(h, eps)
        # The feed-forward block: an MLP, or a mixture of experts under the family's name for it.
        moe = cfg.family.moe
        self.ffn_name = "mlp" if moe is None else moe.block
        self.add_module(self.ffn_name, MLP(cfg) if moe is None else SparseMoe(cfg))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, positions=positions, mask=mask)
        if self.sandwich:  # Gemma: the sublayers' outputs are normed before the residual add
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = NORMS[cfg.family.norm](cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.ropes)


class FastPath(Protocol):
    """A one-call decode path the model carries in `CausalLM.decode_path`: every layer of a step
    in one call (on a CPU, `quantkit.runtime.fast_path.CpuDecodePath`, the C step). The model
    only binds it to each cache and asks it to `run`; the callers (generate through the
    model's forward, the serving engine, the benchmarks) use the rest."""

    max_rows: int  # the longest one-row prefill run as rows of one call; longer ones: PyTorch
    act_dtype: torch.dtype  # the dtype of the activations its matmuls take
    step: object | None  # the bound step; None when `reason` says why nothing is bound
    reason: str  # "bound", or why the path cannot run the model's current cache

    def bind(self, model: CausalLM) -> None:
        """Bind to the model's current cache (`setup_cache`, `drop_cache`), or set `reason`."""
        ...

    def unsupported(self, model: CausalLM) -> str | None:
        """Why the path cannot run `model` whatever its cache, or None when it can."""
        ...

    def run(
        self,
        model: CausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        last_only: bool = False,
    ) -> torch.Tensor | None:
        """Hidden states [B, T, H] after every layer (row b at cache row b), or None when the
        bound step does not apply to this call (then the PyTorch layers run). last_only: only
        the last position's state is wanted ([B, 1, H] may come back)."""
        ...

    def is_current(self) -> bool:
        """True when a step is bound and its cache is still the model's."""
        ...

    def run_rows(
        self,
        model: CausalLM,
        tokens: list[int],
        positions: list[int],
        slots: list[int] | None = None,
        *,
        row_invariant: bool = False,
        out_rows: int | None = None,
    ) -> torch.Tensor:
        """Hidden states [R, 1, H] after every layer: token r at cache row slots[r] (default
        r), position positions[r]; the caller vouches that the bound cache is the model's.
        row_invariant: each row bit-identical to a one-row call (speculative verification).
        out_rows: only the last out_rows rows' states are wanted (default all)."""
        ...

    @property
    def tail_rows(self) -> bool:
        """Whether `out_rows` leaves the wanted rows' bits as a whole call gives them."""
        ...

    def unbound(self) -> FastPath:
        """A new path with the same settings, bound to nothing yet."""
        ...


class CausalLM(nn.Module):
    """The whole model: `forward(ids)` for full sequences; `setup_cache` + positions for decode."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A `quantkit.runtime.fast_path.CpuDecodePath` (see enable_cpu_decode): every layer of a
        # one-token-per-row step in one C call. Bound to each cache by setup_cache.
        self.decode_path: FastPath | None = None
        # The KV cache's format (`quantkit.models.kv_cache`): None or "auto" stores the
        # model's dtype; "bfloat16", "int8", "fp8" ... (`--kv-dtype`). Read by setup_cache.
        self.kv_dtype: str | None = None

    @property
    def family(self) -> Family:
        """The model family's registry entry: which Linears, fusions, layer layout, ..."""
        return self.config.family

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, K, D] for positions [B, T]: K rotary tables (1 but for Gemma 3)."""
        return self.model.rotary(positions, self.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, H], times sqrt(H) where the family scales them (Gemma)."""
        x = self.model.embed_tokens(input_ids)
        if self.family.embed_scale:
            return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def setup_cache(self, *, batch: int, max_len: int) -> None:
        cfg, fmt = self.config, kv_format(self.kv_dtype, self.dtype)
        where = {"dtype": self.dtype, "device": self.device, "fmt": fmt}
        for layer in self.model.layers:
            layer.self_attn.cache = KVCache(batch, max_len, cfg.num_kv_heads, cfg.head_dim, **where)
        if self.decode_path is not None:
            self.decode_path.bind(self)

    def drop_cache(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.cache = None
        if self.decode_path is not None:
            self.decode_path.bind(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only or logits_at).

        Without `positions`, rows are full sequences starting at position 0 (no cache).
        `logits_at` int64 [B]: the one index per row whose logits are wanted (the last real
        token of each row of a right-padded batch); the lm_head then runs on B rows, not B x T."""
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = None
        if (t == 1 or b == 1) and self.decode_path is not None and _eager_cpu(input_ids):
            # One prompt whose last position's logits are wanted (a prefill): the path may
            # return that position's state alone, having computed no more of the others'.
            last = last_only or (logits_at is not None and b == 1 and int(logits_at[0]) == t - 1)
            x = self.decode_path.run(self, input_ids, positions, last_only=last)
            if x is not None and x.shape[1] != t:
                return self.logits(x)
        if x is None:
            cos, sin = self.rope(positions)
            x = self.embed(input_ids)
            for layer in self.model.layers:
                x = layer(x, cos, sin, positions=positions, mask=mask)
        if logits_at is not None:
            x = x[torch.arange(b, device=x.device), logits_at].unsqueeze(1)
        elif last_only:
            x = x[:, -1:]
        return self.logits(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states [B, T, H] after the last layer -> fp32 logits."""
        logits = self.lm_head(self.model.norm(hidden)).float()
        cap = self.config.final_softcap
        if cap is None:
            return logits
        if torch.is_grad_enabled():
            return torch.tanh(logits / cap) * cap
        # In place: the same values without two more vocabulary-wide copies (2 GB a batch of
        # windows at Gemma 2's vocabulary).
        return logits.div_(cap).tanh_().mul_(cap)


def build_model(
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    modules: dict[str, nn.Module] | None = None,
) -> CausalLM:
    """A CausalLM carrying `state` (HF names). `modules` replaces Linears by name, e.g. with
    QuantLinear instances; their own tensors are not looked up in `state`."""
    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        model = CausalLM(cfg)
    known = {name for name, _ in model.named_modules()}
    for name, module in (modules or {}).items():
        parent, _, attr = name.rpartition(".")
        if parent not in known or not hasattr(model.get_submodule(parent), attr):
            raise ModelSourceError(
                f"weights: {name} has no place in a {cfg.model_type} of {cfg.num_layers} layers "
                f"(config.json); expected the config that matches the weights"
            )
        setattr(model.get_submodule(parent), attr, module)
    state = dict(state)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    wanted = wanted_tensors(model, modules or {})
    check_weights(cfg, model, {k: tuple(v.shape) for k, v in state.items()}, wanted)
    dense = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k in wanted
    }
    model.load_state_dict(dense, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers that are not weights (RoPE frequencies) were created on meta: rebuild them.
    model.model.rotary = Rotary(cfg.head_dim, cfg.ropes)
    for module in (modules or {}).values():
        module.to(dense["model.embed_tokens.weight"].device)
    return model.eval()


def wanted_tensors(model: nn.Module, modules: dict[str, nn.Module]) -> set[str]:
    """The state-dict names `model` loads from a checkpoint: its parameters and buffers but the
    rotary frequencies (rebuilt) and the tensors of `modules` (replaced by name)."""
    wanted = {k for k, _ in model.named_parameters()} | {
        k for k, _ in model.named_buffers() if not k.endswith("inv_freq")
    }
    return wanted - {k for k in wanted if any(k.startswith(m + ".") for m in modules)}


def check_weights(
    cfg: ModelConfig,
    model: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    wanted: set[str],
) -> None:
    """The weights' names and `shapes` against the model the config describes (built on meta):
    a layer beyond the config's count, a missing tensor or a wrong shape is a ModelSourceError.
    Called with the shapes alone, before a byte of weights is read, by the streaming loader."""
    beyond = sorted(
        (int(m.group(1)), k)
        for k in shapes
        if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= cfg.num_layers
    )
    if beyond:
        raise ModelSourceError(
            f"weights: {beyond[0][1]} has no place in a model of {cfg.num_layers} layers "
            f"(config.json num_hidden_layers); expected the config that matches the weights"
        )
    missing = sorted(wanted - shapes.keys())
    if missing:
        raise ModelSourceError(
            f"model weights incomplete: expected {len(wanted)} tensors, missing {len(missing)} "
            f"(first: {missing[0]})"
        )
    own = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
    for k in sorted(wanted & shapes.keys()):
        if k in own and shapes[k] != own[k]:
            raise ModelSourceError(
                f"tensor {k}: expected shape {list(own[k])} from config.json, got "
                f"{list(shapes[k])}; the config does not describe these weights"
            )
