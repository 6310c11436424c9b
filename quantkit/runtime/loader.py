"""Load anything quantkit can run: a quantized checkpoint, a dense HF directory, a .gguf file
or the embedded default, as a `CausalLM` with its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.format.checkpoint import load_checkpoint
from quantkit.format.dtypes import name_of
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM, build_model
from quantkit.runtime.fast_path import (
    ACT_DTYPES,
    auto_act_dtype,
    enable_cpu_decode,
    set_act_dtype,
)
from quantkit.runtime.fusion import fuse_projections
from quantkit.runtime.head import HEAD_CHOICES, auto_head_dtype, set_head_dtype
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.sources.resolve import resolve_model
from quantkit.sources.tokenizer import load_tokenizer


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Any
    config: dict[str, Any]
    scheme: QuantScheme | None  # None: dense
    path: Path
    report: dict[str, Any] | None = None
    algorithm: str | None = None  # what chose the codes (rtn, awq, gptq), when recorded

    def describe(self) -> str:
        """'awq int4 g64 asymmetric', 'fp8 e4m3 per-channel (W8A16, gptq)' or 'dense'."""
        return "dense" if self.scheme is None else self.scheme.describe(self.algorithm)


def load_model(
    spec: str | Path,
    *,
    options: RuntimeOptions | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """A ready-to-run model. Quantized Linears become `QuantLinear` (their tensors stay
    compressed); everything else is cast to the options' dtype, and the lm_head and the C
    step's activations get the options' precision. `dtype`/`device` are shorthands for
    `RuntimeOptions(dtype=..., device=...)` (default fp32 on CPU, head and activations as
    stored)."""
    options = options or RuntimeOptions(
        dtype=name_of(dtype) if dtype is not None else "float32", device=str(device or "cpu")
    )
    path = resolve_model(spec)
    loaded = load_checkpoint(path)
    modules: dict[str, torch.nn.Module] = {}
    if loaded.scheme is not None:
        for name in loaded.quantized_modules:
            local = loaded.module_tensors(name)
            bias = local.pop("bias", None)
            # load_checkpoint validated every module (bias included): not once more here.
            modules[name] = QuantLinear.from_tensors(
                local, scheme=loaded.scheme, bias=bias, validated=True
            )
    model = build_model(loaded.config, loaded.tensors, dtype=options.torch_dtype(), modules=modules)
    # The model holds what it needs; the read tensors it replaced (cast, or fused below) go now,
    # not when this function returns.
    loaded.tensors.clear()
    del modules
    model = model.to(options.device)
    # q/k/v and gate/up as one matmul each (row views, no extra memory; see
    # quantkit.runtime.fusion).
    fuse_projections(model)
    # INT4 on CPU: one-token steps run every layer in one C call (quantkit.runtime.fast_path).
    enable_cpu_decode(model)
    _apply_precision(model, options, quantized=loaded.scheme is not None)
    model.kv_dtype = options.kv_dtype  # read by each setup_cache
    tok = load_tokenizer(path) if tokenizer else None
    return LoadedModel(
        model, tok, loaded.config, loaded.scheme, path, loaded.report, loaded.algorithm
    )


def _apply_precision(model: CausalLM, options: RuntimeOptions, *, quantized: bool) -> None:
    """The lm_head's dtype, then the C step's activation dtype ("model" leaves each as is)."""
    for choice, auto, apply, named in (
        (options.head_dtype, auto_head_dtype, set_head_dtype, HEAD_CHOICES),
        (options.act_dtype, auto_act_dtype, set_act_dtype, ACT_DTYPES),
    ):
        if choice != "model":
            dtype = auto(model, quantized=quantized) if choice == "auto" else named[choice]
            apply(model, dtype)
