"""How a loaded model runs: one typed value resolved once, at load time.

Before this, precision was three mutators every caller had to remember in order (`load_model`,
then `set_head_dtype`, then `set_act_dtype`). `RuntimeOptions` names all of it, `resolve` turns
`auto` into concrete dtypes for the model at hand, and `load_model(..., options=...)` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.format.dtypes import DTYPES, dtype_named
from quantkit.models.kv_cache import KV_DTYPE_NAMES
from quantkit.runtime.head import HEAD_CHOICES

Auto = Literal["auto"]
ACT_DTYPE_NAMES = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class RuntimeOptions:
    """dtype: the model's dense weights and activations ("auto": float32 on CPU, bfloat16 on a
    GPU). head_dtype: the lm_head's ("auto": for a quantized fp32 model on a CPU, int8 where
    measured faster, else bf16 on a CPU with bf16 dot instructions, else the model's; "model":
    leave it). act_dtype: the C decode step's INT4 GEMV activations ("auto": int8 or bf16 where
    measured faster, `runtime.fast_path.auto_act_dtype`; "model": leave them fp32). kv_dtype:
    the KV cache's format ("auto": the model's dtype; int8 / fp8: codes with a scale per head
    and token, `quantkit.models.kv_cache`)."""

    dtype: str = "auto"
    device: str = "cpu"
    head_dtype: str = "model"
    act_dtype: str = "model"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        for what, value, allowed in (
            ("dtype", self.dtype, ("auto", *DTYPES)),
            ("head dtype", self.head_dtype, ("auto", "model", *HEAD_CHOICES)),
            ("activation dtype", self.act_dtype, ("auto", "model", *ACT_DTYPE_NAMES)),
            ("kv dtype", self.kv_dtype, ("auto", *KV_DTYPE_NAMES)),
        ):
            if value not in allowed:
                dtype_named(str(value), allowed=allowed, what=what)  # raises with the list

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.float32 if torch.device(self.device).type == "cpu" else torch.bfloat16

    @classmethod
    def cli(cls, *, dtype: str = "auto", device: str = "cpu", act_dtype: str = "auto",
            head_dtype: str = "auto", kv_dtype: str = "auto") -> RuntimeOptions:  # fmt: skip
        """What the commands run with: every precision choice on `auto` unless named."""
        return cls(
            dtype=dtype, device=device, head_dtype=head_dtype, act_dtype=act_dtype,
            kv_dtype=kv_dtype,
        )  # fmt: skip
