"""The output projection in a narrower dtype than the model: half the bytes of the biggest read.

With INT4 Linears, the dense lm_head dominates a small model's decode traffic: SmolLM2-135M's
tied 49152 x 576 head is 113 MB in fp32 against 57 MB for the whole INT4 body. Decode is
bandwidth-bound, so reading it in bf16 halves the largest single read of every step. That pays
only where the CPU has bf16 dot-product instructions (AVX512-BF16, AMX): elsewhere oneDNN's bf16
GEMV is compute-bound and slower than fp32 (ARCHITECTURE.md: 2.3x slower at batch 8 on Zen 3).
Measured on an AVX512-BF16 EPYC, 1 thread: 3.5 ms per token in bf16 vs ~7 ms in fp32.

Only the activation is rounded: the embedded model's weights were bf16 to begin with (the GGUF
is converted to a bf16 directory), so its head loses nothing by the cast. Logits move by ~0.3%
relative, which can flip a greedy choice between near-tied tokens; a dense run that must match
transformers token for token keeps the fp32 head (the default for dense models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.cpu import has_bf16_dot
from quantkit.errors import GenerationError
from quantkit.format.dtypes import DTYPES
from quantkit.format.packing import int8_absmax
from quantkit.fused_kernels.cpu.abi import QK_TOP
from quantkit.fused_kernels.cpu.bf16_gemv import (
    I8I8Weight,
    bf16_gemv,
    bf16_gemv_available,
    i8_gemv,
    i8_gemv_available,
    i8i8_gemv,
    i8i8_gemv_available,
)
from quantkit.fused_kernels.cpu.i6_gemv import (
    GROUP,
    I6_MAX_M,
    I6Weight,
    i6_gemv,
    i6_gemv_available,
)
from quantkit.models.decoder import CausalLM
from quantkit.runtime.kept_argmax import keep
from quantkit.runtime.quant_linear import QuantLinear

# int8: the head's rows rounded to int8 with a scale per row (absmax / 127) when the model
# loads, half the bytes of bf16 (`auto` where measured faster: `auto_head_dtype`).
HEAD_DTYPES = {**DTYPES, "int8": torch.int8}
# Heads that are not a torch dtype: int6, 6-bit codes with an fp16 scale per row and 32
# elements (`Int6Head`), named by `--head-dtype int6` only.
HEAD_FORMATS = ("int6",)
# Every name a head choice may take, and what `set_head_dtype` is given for it.
HEAD_CHOICES: dict[str, torch.dtype | str] = {**HEAD_DTYPES, **{f: f for f in HEAD_FORMATS}}


# Rows up to which a bf16 head on fp32 activations takes the C GEMV (`cpu.bf16_gemv`) rather
# than oneDNN: a decode step's rows and a prefill's last one. SmolLM2's 49152 x 576 head, 2
# threads, called back to back (the weight stays in L3), C vs oneDNN: 1 row 0.74 vs 2.38 ms,
# 8 rows 0.90 vs 3.10, 16 rows 1.66 vs 3.75, 64 rows 6.04 vs 7.23. Inside a decode step, where
# the INT4 body streams between head calls, the C head saved 1.6 ms at 1 row and 1.8 at 8.
HEAD_GEMV_MAX_M = 16


class CastHead(nn.Module):
    """x [..., H] -> x.to(dtype) @ W.T, W [V, H] stored once in `dtype` (accumulated in fp32);
    the caller (`CausalLM.forward`) turns the logits into fp32. A bf16 head on up to
    `HEAD_GEMV_MAX_M` fp32 CPU rows runs the C GEMV (fp32 logits); anything else the BLAS.
    int8: W rounded per row, W8 = round(W / s), s = absmax / 127 (`scale`). On a CPU with
    AVX512-VNNI the C GEMV quantizes x to int8 per block too and multiplies in integers
    (`i8i8_gemv`, over a copy of W8 with 16 rows interleaved): at 8 rows the fp32 one is
    bound by its FMAs. Elsewhere x stays fp32: the C int8 GEMV, or W8 * s dequantized for the
    BLAS (more rows than the GEMVs take)."""

    # Whether the int8 GEMV keeps each row's arg-max as it stores the logits (`kept_argmax`);
    # off under a final soft-cap (`set_head_dtype`).
    keeps_argmax = True

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        w, scale = weight.detach(), None
        if dtype == torch.int8:
            w, scale = int8_absmax(w)
            scale = scale.squeeze(-1).contiguous()
        self.scale: torch.Tensor | None
        self.register_buffer("scale", scale, persistent=False)
        self.weight = nn.Parameter(w.to(dtype).contiguous(), requires_grad=False)
        gemv = {torch.bfloat16: bf16_gemv_available, torch.int8: i8_gemv_available}.get(dtype)
        self._gemv = gemv is not None and self.weight.is_cpu and gemv()
        # int8 on a VNNI CPU: the activations quantized too, the products in integers
        # (`i8i8_gemv`), over a copy of the weight with 16 rows interleaved
        self._i8i8: I8I8Weight | None = None
        if scale is not None and self._gemv and i8i8_gemv_available():
            packed = I8I8Weight(self.weight.data, scale)
            self._i8i8 = packed if packed.block else None

    def weight_bytes(self) -> int:
        """Bytes a step reads: the weight, and the row scales of an int8 head."""
        scale = 0 if self.scale is None else self.scale.numel() * 4
        return self.weight.numel() * self.weight.element_size() + scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if self._gemv and x.dtype == torch.float32 and x.is_cpu and rows <= HEAD_GEMV_MAX_M:
            x2 = x.reshape(rows, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if self._i8i8 is not None:
                if not self.keeps_argmax:
                    return i8i8_gemv(x2, self._i8i8).view(*x.shape[:-1], -1)
                best = torch.empty(rows, QK_TOP, dtype=torch.int64)
                y = keep(i8i8_gemv(x2, self._i8i8, best=best), best)
                return y.view(*x.shape[:-1], -1)
            if self.scale is not None:
                return i8_gemv(x2, self.weight, self.scale).view(*x.shape[:-1], -1)
            return bf16_gemv(x2, self.weight).view(*x.shape[:-1], -1)
        if self.scale is not None:
            return F.linear(x.float(), self.weight.float() * self.scale[:, None])
        return F.linear(x.to(self.weight.dtype), self.weight)


class Int6Head(nn.Module):
    """x [..., H] -> fp32 logits x @ (C * s).T, the head's weight rounded when the model loads
    to 6-bit codes C with an fp16 scale s per row and group of 32 elements (`--head-dtype
    int6`): 6.5 bits a weight against the int8 head's 8, for the memory-bound decode step.
    x is quantized to int8 per block of 32 and multiplied in integers (`cpu.i6_gemv`, 16 rows
    a call); each row's logits are the same bits whatever rows share its call. Held-out
    perplexity of the embedded INT4 model over 32768 tokens (`python -m
    quantkit.evals.studies.head_quality`): fp32 head 22.632, int8 with int8 activations (the
    VNNI default) 22.673, int6 22.764 (+0.40% over int8) for 23.0 MB a step instead of 28.5.
    A scale per row instead of per 32 cost 1.8% (fake-quantized, 8192 tokens). Needs a CPU with
    AVX512-VNNI (`set_head_dtype` checks)."""

    keeps_argmax = True  # as `CastHead.keeps_argmax`

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = I6Weight(weight.detach())
        self.out_features, self.in_features = weight.shape

    def weight_bytes(self) -> int:
        """Bytes a step reads: the packed codes and the group scales."""
        return self.packed.nbytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        best = torch.empty(x2.shape[0], QK_TOP, dtype=torch.int64) if self.keeps_argmax else None
        for r in range(0, x2.shape[0], I6_MAX_M):
            i6_gemv(x2[r : r + I6_MAX_M], self.packed, out=out[r : r + I6_MAX_M],
                    best=None if best is None else best[r : r + I6_MAX_M])  # fmt: skip
        if best is not None:
            keep(out, best)
        return out.view(*lead, self.out_features)


def _int6_head(model: CausalLM) -> None:
    """`set_head_dtype`'s int6: an `Int6Head` from the head's weight, where the kernel runs (a
    CPU with AVX512-VNNI) and the hidden size is a multiple of 32; else a `GenerationError`."""
    if isinstance(model.lm_head, Int6Head):
        return
    if model.device.type != "cpu" or not i6_gemv_available():
        raise GenerationError(
            f"head dtype int6: expected a CPU with AVX512-VNNI, got {model.device.type}"
            + (" without it" if model.device.type == "cpu" else "")
        )
    width = model.lm_head.weight.shape[1]
    if width % GROUP:
        raise GenerationError(
            f"head dtype int6: expected a hidden size that is a multiple of {GROUP}, got {width}"
        )
    model.lm_head = Int6Head(model.lm_head.weight)


def logits_of_rows(model: CausalLM, hidden: torch.Tensor, *, row_invariant: bool) -> torch.Tensor:
    """fp32 logits [R, V] of hidden states [R, 1, H]. row_invariant: each row exactly as a
    one-row call computes it. The C bf16 and int8 GEMVs give that for all the rows they take
    (they share weight loads, never sums), so it runs them `HEAD_GEMV_MAX_M` at a time; any
    other head (a BLAS GEMM picks its blocking by the row count) runs one row at a time, as
    plain decoding does."""
    if not row_invariant:
        return model.logits(hidden)[:, -1]
    head = model.lm_head
    step = HEAD_GEMV_MAX_M if isinstance(head, CastHead) and head._gemv else 1
    if isinstance(head, Int6Head):  # row-invariant in any call
        step = hidden.shape[0]
    if hidden.shape[0] <= step:
        return model.logits(hidden)[:, -1]
    return torch.cat([model.logits(part)[:, -1] for part in hidden.split(step)])


def head_name(model: CausalLM) -> str:
    """How the lm_head is stored, for summaries: a dtype name, or the quantized format."""
    head = model.lm_head
    if isinstance(head, QuantLinear):
        return head.scheme.describe()
    if isinstance(head, Int6Head):
        return f"int6 g{GROUP}"
    return str(head.weight.dtype).removeprefix("torch.")


def auto_head_dtype(model: CausalLM, *, quantized: bool) -> torch.dtype:
    """For a quantized fp32 model on a CPU: int8 where the int8 head was measured faster
    (`int8_head_faster`), else bf16 on a CPU with bf16 instructions, else fp32.

    Dense models keep their head so that they compute what transformers computes; a quantized
    head (`QuantLinear`) keeps its own format."""
    if isinstance(model.lm_head, QuantLinear):
        return model.dtype
    if quantized and model.dtype == torch.float32 and model.device.type == "cpu":
        if int8_head_faster():
            return torch.int8
        return torch.bfloat16 if has_bf16_dot() else torch.float32
    return model.dtype


def int8_head_faster() -> bool:
    """Whether the int8 head beats the bf16 one on this CPU: wherever the int8 GEMV builds
    (AVX-512), Intel and AMD. SmolLM2 INT4, 2 threads: 28.5 MB a step instead of 56.6;
    - Intel Xeon (family 6 model 207): the head 1.0-1.6 ms instead of 2.7-3.2, 109.9 tok/s
      against 88.9 interleaved in one process;
    - AMD EPYC Zen 4 (family 25 model 17), int8 activations: the head 1.06 ms instead of 2.19
      (`evals.decode_phases`), 217.5 tok/s against 173.8, five rounds interleaved.
    Held-out perplexity over 32768 tokens 23.444 against 23.434 (+0.04%, `evals.head_quality`).
    At 8 rows the fp32-activation int8 GEMV is compute-bound, slower than bf16's (3.0 against
    2.4 ms on the Zen 4); the VNNI one (`i8i8_gemv`) took 1.3 ms."""
    return i8_gemv_available()


def set_head_dtype(model: CausalLM, dtype: torch.dtype | str) -> None:
    """Run `model`'s lm_head in `dtype`, a torch dtype of `HEAD_DTYPES` or "int6" (`Int6Head`)
    (a copy of the weight; the embedding table is kept as it is, so a tied head stops being
    tied). No-op when the head already has that dtype."""
    if dtype not in HEAD_DTYPES.values() and dtype not in HEAD_FORMATS:
        raise GenerationError(f"head dtype: expected one of {', '.join(HEAD_CHOICES)}, got {dtype}")
    if isinstance(model.lm_head, QuantLinear):
        if dtype != model.dtype:
            raise GenerationError(
                f"head dtype: the checkpoint's lm_head is quantized ({model.lm_head.scheme.kind}), "
                f"expected auto or the model's dtype, got {dtype}"
            )
        return
    if dtype == "int6":
        _int6_head(model)
    elif model.lm_head.weight.dtype != dtype:
        model.lm_head = CastHead(model.lm_head.weight, dtype)
    # A final soft-cap rewrites the logits in place after the head (`CausalLM.logits`): the
    # arg-max the kernel kept would then name the wrong token.
    if isinstance(model.lm_head, CastHead | Int6Head):
        model.lm_head.keeps_argmax = model.config.final_softcap is None
