"""The one-call CPU decode step (`fused_kernels.decode_cpu`) wired into `CausalLM`.

`enable_cpu_decode(model)` attaches a `CpuDecodePath`. Each `setup_cache` binds it to the new
cache when the model qualifies (CPU, fp32 activations, every Linear INT4 on the C kernel, q/k/v
and gate/up fused, a batch of one); a forward pass of one token of one sequence then runs all
layers in one C call, and everything else takes the PyTorch path. QUANTKIT_CPU_DECODE=0 turns
it off (for comparisons). Measured on SmolLM2-135M INT4, 2 threads: see DESIGN.md / the
decode benchmark.
"""

from __future__ import annotations

import os

import torch

from quantkit.model import CausalLM
from quantkit.quant_linear import QuantLinear

__all__ = ["CpuDecodePath", "enable_cpu_decode"]


def _cpu_int4(module: object) -> object | None:
    """The bound C kernel of an INT4 QuantLinear on the cpu backend, else None."""
    if not isinstance(module, QuantLinear) or not module.scheme.is_int:
        return None
    prepared = module._prepared_int4()
    return prepared.run if prepared.backend == "cpu" else None


class CpuDecodePath:
    """Binds `fused_kernels.decode_cpu.CpuDecodeStep` to a model's current KV cache."""

    def __init__(self) -> None:
        self.step = None
        self._caches: list[torch.Tensor] = []
        self.reason = "no cache set up yet"

    def bind(self, model: CausalLM) -> None:
        """Bind to the cache `setup_cache` just made, or explain (`reason`) why not."""
        self.step, self._caches = None, []
        self.reason = self._bind(model)

    def _bind(self, model: CausalLM) -> str:
        if os.environ.get("QUANTKIT_CPU_DECODE") == "0":
            return "QUANTKIT_CPU_DECODE=0"
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return f"needs fp32 on CPU, got {model.dtype} on {model.device.type}"
        from quantkit.fused_kernels.decode_cpu import (
            CpuDecodeStep,
            DecoderDims,
            DecoderLayerParts,
        )

        parts = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            fused = [attn.fused_qkv, mlp.fused_gate_up]
            if any(f is None or not f.valid() for f in fused):
                return f"layer {i}: q/k/v or gate/up not fused"
            kernels = [_cpu_int4(m) for m in (fused[0].fused, attn.o_proj)]
            kernels += [_cpu_int4(m) for m in (fused[1].fused, mlp.down_proj)]
            if any(k is None for k in kernels):
                return f"layer {i}: a Linear is not INT4 on the cpu backend"
            cache = attn.cache
            if cache is None or cache.k.shape[0] != 1:
                return "needs a cache of batch 1"
            parts.append(
                DecoderLayerParts(
                    *kernels,  # type: ignore[arg-type]
                    in_norm=layer.input_layernorm.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    k_cache=cache.k,
                    v_cache=cache.v,
                )
            )
        cfg = model.config
        dims = DecoderDims(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.rms_norm_eps,
        )  # fmt: skip
        try:
            self.step = CpuDecodeStep(parts, dims)
        except ValueError as exc:
            return str(exc)
        self._caches = [p.k_cache for p in parts]
        return "bound"

    def run(self, model: CausalLM, input_ids: torch.Tensor, position: int) -> torch.Tensor | None:
        """The final hidden state [1, 1, H] after every layer for one token, or None when the
        bound step does not apply (no step, or the cache was replaced since binding)."""
        step = self.step
        if step is None:
            return None
        layers = model.model.layers
        if any(
            layer.self_attn.cache.k is not k for layer, k in zip(layers, self._caches, strict=True)
        ):
            return None
        cos, sin = model.rope(torch.tensor([[position]]))
        x = model.model.embed_tokens(input_ids).contiguous()
        step(x.view(-1), position, cos.contiguous().view(-1), sin.contiguous().view(-1))
        return x


def enable_cpu_decode(model: CausalLM) -> CpuDecodePath:
    """Attach a CpuDecodePath to `model` (bound at each `setup_cache`)."""
    path = CpuDecodePath()
    object.__setattr__(model, "decode_path", path)
    return path
