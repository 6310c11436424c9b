"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) built from config.json.

Module names follow Hugging Face's (`model.layers.3.self_attn.q_proj`, ...) so a checkpoint's
state dict loads without renaming. What differs between families (biases, norm kind, rope
settings) comes from the family's registry entry (`families.py`), looked up once per model and
carried as `CausalLM.family` for everything downstream (fusion, the C step, AWQ/GPTQ). Any
Linear may be a dense `nn.Linear` or a `QuantLinear`; the model does not care.

Shapes: B batch, T new tokens, S cache length, H hidden, Hq/Hkv heads, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import ModelSourceError
from quantkit.models.families import family_for
from quantkit.models.family import Family, Rope


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
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    biases: tuple[str, ...]  # the Linears of a layer that carry a bias

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        family = family_for(cfg)  # raises for unsupported families
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            family=family,
            model_type=str(cfg["model_type"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=family.rope(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            biases=family.biased(cfg),
        )

    def linear(self, name: str, n: int, k: int) -> nn.Linear:
        """The layer's Linear `name` [n, k], with a bias where the family puts one."""
        return nn.Linear(k, n, bias=name in self.biases)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one op, the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like the HF reference, so bf16 runs match it.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """RoPE in the HF layout (rotate_half over the two halves of each head); the frequencies
    are the family's (`Family.rope`)."""

    def __init__(self, head_dim: int, rope: Rope) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope.inv_freq(head_dim), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, 1, D] (for q/k laid out [B, T, heads, D])."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
        return emb.cos().to(dtype), emb.sin().to(dtype)


# The norm kinds a family may name (`Family.norm`).
NORMS: dict[str, type[nn.Module]] = {"rmsnorm": RMSNorm}


def _eager_cpu(x: torch.Tensor) -> bool:
    """True when a data-dependent fast path may read tensor values on the host: a CPU tensor,
    outside torch.compile's tracing."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class KVCache(nn.Module):
    """Static, preallocated K/V for one layer: [B, Hkv, S, D], written at explicit positions."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, Hkv, D] at positions [B, T]; return the whole cache."""
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        # Index the (B, S) axes together: each row writes at its own positions.
        self.k.permute(0, 2, 1, 3)[rows, positions] = k
        self.v.permute(0, 2, 1, 3)[rows, positions] = v
        return self.k, self.v

    def write_span(self, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """One row (B = 1) whose T new tokens sit at slots start..start+T-1: two slice copies
        instead of two index_puts. Returns the end slot."""
        end = start + k.shape[1]
        self.k[0, :, start:end].copy_(k[0].transpose(0, 1))
        self.v[0, :, start:end].copy_(v[0].transpose(0, 1))
        return end


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = cfg.linear("self_attn.q_proj", cfg.num_heads * d, h)
        self.k_proj = cfg.linear("self_attn.k_proj", cfg.num_kv_heads * d, h)
        self.v_proj = cfg.linear("self_attn.v_proj", cfg.num_kv_heads * d, h)
        self.o_proj = cfg.linear("self_attn.o_proj", h, cfg.num_heads * d)
        self.cache: KVCache | None = None
        # A `quantkit.runtime.fusion.FusedLinear`, set by fuse_projections.
        self.fused_qkv: Any = None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, Hq, D] with RoPE not yet applied, k, v [B, T, Hkv, D]."""
        b, t, _ = x.shape
        fused = self.fused_qkv
        if fused is not None and fused.valid():
            heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
            qkv = fused(x).view(b, t, sum(heads), self.head_dim)
            q, k, v = qkv.split(heads, dim=2)
            return q, k, v
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
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
        """x [B, T, H]. Without a cache: causal attention over x alone. With one: k/v are
        written at `positions` and queries attend to the cache under `mask` [B, 1, T, S]."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cache is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        elif b == 1 and positions is not None and _eager_cpu(x):
            # One row: its tokens sit at consecutive slots, and the query attends to the
            # slots up to its own only (not the whole cache under a mask).
            start = int(positions[0, 0])
            end = self.cache.write_span(start, k, v)
            keys, values = self.cache.k[:, :, :end], self.cache.v[:, :, :end]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=t > 1 and start == 0,
                attn_mask=None if t == 1 or start == 0 else mask[..., :end], enable_gqa=True,
            )  # fmt: skip
        else:
            assert positions is not None and mask is not None
            keys, values = self.cache.update(positions, k, v)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = cfg.linear("mlp.gate_proj", i, h)
        self.up_proj = cfg.linear("mlp.up_proj", i, h)
        self.down_proj = cfg.linear("mlp.down_proj", h, i)
        # A `quantkit.runtime.fusion.FusedLinear`, see fuse_projections.
        self.fused_gate_up: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        if fused is not None and fused.valid():
            gate, up = fused(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        norm = NORMS[cfg.family.norm]
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions=positions, mask=mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = NORMS[cfg.family.norm](cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope)


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
        self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """Hidden states [B, T, H] after every layer (row b at cache row b), or None when the
        bound step does not apply to this call (then the PyTorch layers run)."""
        ...

    def run_rows(
        self,
        model: CausalLM,
        tokens: list[int],
        positions: list[int],
        slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [R, 1, H] after every layer: token r at cache row slots[r] (default
        r), position positions[r]; the caller vouches that the bound cache is the model's."""
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
        return self.model.rotary(positions, self.dtype)

    def setup_cache(self, *, batch: int, max_len: int) -> None:
        cfg, where = self.config, {"dtype": self.dtype, "device": self.device}
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
            x = self.decode_path.run(self, input_ids, positions)
        if x is None:
            cos, sin = self.rope(positions)
            x = self.model.embed_tokens(input_ids)
            for layer in self.model.layers:
                x = layer(x, cos, sin, positions=positions, mask=mask)
        if logits_at is not None:
            x = x[torch.arange(b, device=x.device), logits_at].unsqueeze(1)
        elif last_only:
            x = x[:, -1:]
        return self.logits(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states [B, T, H] after the last layer -> fp32 logits."""
        return self.lm_head(self.model.norm(hidden)).float()


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
    for name, module in (modules or {}).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, module)
    state = dict(state)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    wanted = {k for k, _ in model.named_parameters()} | {
        k for k, _ in model.named_buffers() if not k.endswith("inv_freq")
    }
    wanted -= {k for k in wanted if any(k.startswith(m + ".") for m in (modules or {}))}
    missing = sorted(wanted - state.keys())
    if missing:
        raise ModelSourceError(
            f"model weights incomplete: expected {len(wanted)} tensors, missing {len(missing)} "
            f"(first: {missing[0]})"
        )
    dense = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k in wanted
    }
    model.load_state_dict(dense, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers that are not weights (RoPE frequencies) were created on meta: rebuild them.
    model.model.rotary = Rotary(cfg.head_dim, cfg.rope)
    for module in (modules or {}).values():
        module.to(dense["model.embed_tokens.weight"].device)
    return model.eval()
