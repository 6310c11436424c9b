"""The decoder's building blocks that hold no family knowledge: the norms, the rotary tables,
the masks and the attention product (the KV cache: `quantkit.models.kv_cache`).

Shapes: B batch, T new tokens, S cache length, K rope tables, D head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.rope import Rope


class RMSNorm(nn.Module):
    """x / rms(x) * w (Llama, Qwen, Phi-3)."""

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

    def divide_output_(self, s: torch.Tensor) -> None:
        """Scale the output by 1/s per channel (AWQ folds its scales here)."""
        self.weight.data.div_(s)

    def multiplier(self) -> torch.Tensor:
        """The fp32 vector the normalised x is multiplied by (a copy where it is computed):
        what the C decode step takes as this norm's weight."""
        return self.weight.detach().float().contiguous()


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), multiplied in fp32 before the cast (Gemma 2 / 3). The weight
    stored is w, so an all-zero weight is the identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)

    def divide_output_(self, s: torch.Tensor) -> None:
        self.weight.data.copy_((1.0 + self.weight.data) / s - 1.0)

    def multiplier(self) -> torch.Tensor:
        return (1.0 + self.weight.detach().float()).contiguous()


# The norm kinds a family may name (`Family.norm`).
NORMS: dict[str, type[RMSNorm]] = {"rmsnorm": RMSNorm, "gemma_rmsnorm": GemmaRMSNorm}

# The MLP activations a config.json may name (`hidden_activation` / `hidden_act`).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Rotary(nn.Module):
    """RoPE in the HF layout (rotate_half over the two halves of each head), for K tables at
    once (one per distinct layer rope; layer i reads table `rope_index`)."""

    def __init__(self, head_dim: int, ropes: tuple[Rope, ...]) -> None:
        super().__init__()
        inv = torch.stack([r.inv_freq(head_dim) for r in ropes])  # [K, D/2]
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, K, D] (K = 1: broadcast over q/k's heads)."""
        freqs = positions.float()[..., None, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def window_mask(
    positions: torch.Tensor, slots: int, window: int, mask: torch.Tensor | None
) -> torch.Tensor:
    """[B, 1, T, S] bool: `mask` (causal when None: slot <= position) and slot > position -
    window, transformers' sliding-window rule. Slot s of a cache holds position s."""
    slot = torch.arange(slots, device=positions.device)
    pos = positions[:, None, :, None]
    allowed = slot > pos - window
    return allowed & (slot <= pos if mask is None else mask)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped] [masked]) v, q [B, Hq, T, D], k, v [B, Hkv, S, D].
    Soft-capping (Gemma 2: cap * tanh(logits / cap)) is not in SDPA: an explicit product."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q, k.transpose(2, 3)) * (scale or q.shape[-1] ** -0.5)
    logits = torch.tanh(logits / softcap) * softcap
    if causal:
        t, s = logits.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
