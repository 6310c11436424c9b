"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE), in place of a layer's MLP.

A router (a dense Linear, hidden -> experts) scores every token; the `top_k` best experts by
softmax probability each run the token through their SiLU-gated MLP, and the outputs are summed
weighted by those probabilities (renormalized to sum 1 where the family does). Each expert runs
on the tokens routed to it only, so a forward hook on an expert's Linear sees exactly its routed
tokens (AWQ and GPTQ calibrate on those), and an expert no token picked is not called at all.

Expert order and arithmetic follow transformers' `MixtralExperts` (experts in index order, each
output added with `index_add_`), so fp32 logits match it to rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.config import ModelConfig
from quantkit.models.layers import ACTIVATIONS


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), its Linears under the family's names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe, sizes = cfg.family.moe, cfg.moe
        assert moe is not None and sizes is not None
        h, i = cfg.hidden_size, sizes.intermediate
        self.names = (moe.gate, moe.up, moe.down)
        for name, n, k in zip(self.names, (i, i, h), (h, h, i), strict=True):
            self.add_module(name, nn.Linear(k, n, bias=False))  # no family has expert biases
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


class SparseMoe(nn.Module):
    """x [..., H] -> [..., H]: the router's top-k experts per token, weighted and summed."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe, sizes = cfg.family.moe, cfg.moe
        assert moe is not None and sizes is not None
        self.top_k, self.renormalize = sizes.top_k, sizes.renormalize
        self.add_module(moe.router, nn.Linear(cfg.hidden_size, sizes.experts, bias=False))
        self.router_name = moe.router
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(sizes.experts))

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [N, H] -> (routing weights [N, top_k] in flat's dtype, experts [N, top_k])."""
        logits = getattr(self, self.router_name)(flat)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(flat.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            if token.numel() == 0:  # not called: its hooks see routed tokens only
                continue
            y = expert(flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(x.shape)
