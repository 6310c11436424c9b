"""The one-call CPU decode step (`fused_kernels.decode_cpu`) wired into `CausalLM`.

`enable_cpu_decode(model)` attaches a `CpuDecodePath`. Each `setup_cache` binds it to the new
cache when the model qualifies (a family with a C layer layout, `model.family.decode`; CPU, fp32
activations, every Linear INT4 on the C kernel, q/k/v and gate/up fused); a forward pass of one
new token per row (any batch), or of one row's T tokens (a prefill), then runs all layers in one
C call, and everything else takes the PyTorch path. Row b sits at cache row b and each token
attends to its row's positions <= its own: the mask every caller here builds (`generate`'s right
padding and causal prefill, the serving engine's slots and prompt chunks). Prefills longer than
the GEMV's measured crossover (`GEMV_MAX_M`, where dequantize + MKL wins) stay on the PyTorch
path, except with int8 activations, which run them through the step in chunks (`chunks`).
QUANTKIT_CPU_DECODE=0 turns it off (for comparisons). Measured on SmolLM2-135M INT4, 2
threads: see ARCHITECTURE.md / the decode benchmark.

Activations. The GEMVs take fp32 activations by default, which the tests hold to the PyTorch
path within 1e-5. `set_act_dtype(model, torch.bfloat16)` rounds them to bf16 inside the GEMVs
(W4A16 in the strict sense; vdpbf16ps on AVX512-BF16 CPUs, sums in fp32, the rest of each
layer fp32). `set_act_dtype(model, torch.int8)` quantizes them to int8 per block of 32-128
elements inside a group (64 at SmolLM2's g64) and multiplies them by the 4-bit weights in
integers (vpdpbusd on AVX512-VNNI CPUs, over a copy of the weights with 16 rows interleaved).
Which is
fastest depends on the CPU, so `auto_act_dtype` (the CLI's `auto`) picks each only where it
was measured faster: int8 on CPUs with AVX512-VNNI, Intel and AMD (`int8_activations_faster`),
else bf16 on AMD ones with AVX512-BF16 (`bf16_activations_faster`), else fp32. What each costs in
perplexity is measured by `quantkit.evals.studies.act_precision` (int8: +0.12% on SmolLM2 INT4).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from quantkit.errors import GenerationError
from quantkit.fused_kernels.cpu.decode import (
    ACTIVATION_CODES,
    CpuDecodeStep,
    DecoderDims,
    DecoderLayerParts,
    bf16_activations_available,
    int8_activations_available,
)
from quantkit.models.decoder import CausalLM
from quantkit.models.family import DecodeLayout, layer_part
from quantkit.runtime.quant_linear import QuantLinear

__all__ = [
    "ACT_DTYPES",
    "CpuDecodePath",
    "auto_act_dtype",
    "bf16_activations_available",
    "bf16_activations_faster",
    "enable_cpu_decode",
    "int8_activations_available",
    "int8_activations_faster",
    "set_act_dtype",
]

ACT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _cpu_int4(module: object) -> object | None:
    """The bound C kernel of an INT4 QuantLinear on the cpu backend, else None."""
    if not isinstance(module, QuantLinear) or not module.scheme.format.c_step:
        return None
    prepared = module._prepared()
    return prepared.run if prepared.backend == "cpu" else None


class CpuDecodePath:
    """Binds `fused_kernels.decode_cpu.CpuDecodeStep` to a model's current KV cache."""

    def __init__(self, act_dtype: torch.dtype = torch.float32) -> None:
        from quantkit.fused_kernels.cpu.build import cpu_variant
        from quantkit.fused_kernels.cpu.w4a16 import GEMV_MAX_M

        self.max_rows = GEMV_MAX_M.get(cpu_variant(), 1)  # a longer prefill: PyTorch + MKL
        self.act_dtype = act_dtype  # the GEMVs' activations (`set_act_dtype`)
        self.step = None
        # (each layer's attention module, the K cache tensor bound): a new cache unbinds.
        self._caches: list[tuple[Any, torch.Tensor]] = []
        self.reason = "no cache set up yet"
        # cos, sin [P, D] for positions 0..P-1, kept across binds (the model's rope is fixed):
        # a step looks its rows up instead of computing them (22 us a step at batch 1)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind(self, model: CausalLM) -> None:
        """Bind to the cache `setup_cache` just made, or explain (`reason`) why not."""
        self.step, self._caches = None, []
        self.reason = self._bind(model)

    @staticmethod
    def _layer_kernels(
        layout: DecodeLayout, layer: object
    ) -> tuple[list[object | None], list[tuple[object | None, ...]] | None] | None:
        """A decoder layer's bound C kernels (None where a Linear is not INT4 on the cpu
        backend): [qkv, o, gate_up, down] and None, or for a mixture of experts [qkv, o] and
        each expert's (gate, up, down); None when q/k/v or gate/up are not fused. A layout part
        that is a Linear (a checkpoint storing q/k/v fused, Phi-3) is its own matmul."""
        fused = [layer_part(layer, name) for name in (layout.qkv, layout.gate_up) if name]
        if any(part is None or (hasattr(part, "valid") and not part.valid()) for part in fused):
            return None
        matmuls = [getattr(part, "fused", part) for part in fused]
        kernels = [_cpu_int4(matmuls[0]), _cpu_int4(layer_part(layer, layout.o))]
        if layout.moe is not None:
            experts = layer_part(layer, layout.moe).experts
            return kernels, [tuple(_cpu_int4(getattr(e, n)) for n in e.names) for e in experts]
        assert layout.down is not None
        return [*kernels, _cpu_int4(matmuls[1]), _cpu_int4(layer_part(layer, layout.down))], None

    def unsupported(self, model: CausalLM) -> str | None:
        """Why the step cannot run `model` (whatever its cache), or None when it can."""
        if os.environ.get("QUANTKIT_CPU_DECODE") == "0":
            return "QUANTKIT_CPU_DECODE=0"
        layout = model.family.decode
        why = model.config.pytorch_only()
        if layout is None or why is not None:
            return why or f"family {model.family.name}: no C decode layout"
        if model.config.activation not in ACTIVATION_CODES:
            return f"a {model.config.activation} MLP (the C step's: {', '.join(ACTIVATION_CODES)})"
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return f"needs fp32 on CPU, got {model.dtype} on {model.device.type}"
        for i, layer in enumerate(model.model.layers):
            found = self._layer_kernels(layout, layer)
            if found is None:
                return f"layer {i}: q/k/v or gate/up not fused"
            kernels, experts = found
            if any(k is None for k in kernels) or any(None in e for e in experts or ()):
                return f"layer {i}: a Linear is not INT4 on the cpu backend"
        return None

    def _bind(self, model: CausalLM) -> str:
        reason = self.unsupported(model)
        if reason is not None:
            return reason
        layout = model.family.decode
        assert layout is not None
        parts = []
        for layer in model.model.layers:
            found = self._layer_kernels(layout, layer)
            assert found is not None
            kernels, experts = found
            router = None
            if layout.moe is not None:
                block = layer_part(layer, layout.moe)
                router = getattr(block, block.router_name).weight.detach().float().contiguous()
                kernels += [None, None]
            attention = layer_part(layer, layout.attention)
            if attention.cache is None:
                return "needs a KV cache"

            def norm(name: str | None, layer: object = layer) -> torch.Tensor | None:
                return None if name is None else layer_part(layer, name).multiplier()

            parts.append(
                DecoderLayerParts(
                    *kernels,  # type: ignore[arg-type]
                    in_norm=norm(layout.in_norm),  # type: ignore[arg-type]
                    post_norm=norm(layout.post_norm),  # type: ignore[arg-type]
                    k_cache=attention.cache.k,
                    v_cache=attention.cache.v,
                    q_norm=norm(layout.q_norm),
                    k_norm=norm(layout.k_norm),
                    attn_out_norm=norm(layout.attn_out_norm),
                    ffn_out_norm=norm(layout.ffn_out_norm),
                    sliding=attention.window is not None,
                    rope=attention.rope_index,
                    router=router,
                    experts=None if experts is None else tuple(experts),  # type: ignore[arg-type]
                )
            )
        cfg = model.config
        moe = cfg.moe
        dims = DecoderDims(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.rms_norm_eps, window=cfg.sliding_window,
            ropes=len(cfg.ropes), activation=cfg.activation, attn_scale=cfg.attn_scale,
            attn_softcap=cfg.attn_softcap, experts=moe.experts if moe else 0,
            top_k=moe.top_k if moe else 0, renormalize=bool(moe and moe.renormalize),
            expert_inter=moe.intermediate if moe else 0,
        )  # fmt: skip
        try:
            self.step = CpuDecodeStep(parts, dims, act_dtype=self.act_dtype)
        except ValueError as exc:
            return str(exc)
        attention = [layer_part(layer, layout.attention) for layer in model.model.layers]
        self._caches = [(a, p.k_cache) for a, p in zip(attention, parts, strict=True)]
        return "bound"

    def run(
        self,
        model: CausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        last_only: bool = False,
    ) -> torch.Tensor | None:
        """The final hidden states [B, T, H] after every layer for one new token per row
        (input_ids, positions [B, 1]; row b at cache row b) or one prompt (B = 1), or None when
        the bound step does not apply (no step, or the cache was replaced since binding).
        last_only: of a prompt, only its last token's state is wanted ([1, 1, H] may come
        back): with int8 activations the last layer computes the other tokens' keys and values
        and nothing more for them (1/16 of a 16-layer model's prefill), the last row's state
        the same bits (`tail_rows`)."""
        step = self.step
        if step is None or not self.is_current():
            return None
        b, t = input_ids.shape
        if b > step.cache_rows or (t > 1 and (b > 1 or t > self.max_rows and not self.chunks)):
            return None
        ids, pos = input_ids.view(-1).tolist(), positions.reshape(-1).tolist()
        last_only = last_only and t > 1 and self.tail_rows
        if t <= self.max_rows:
            hidden = self.run_rows(model, ids, pos, [0] * t if t > 1 else None,
                                   out_rows=1 if last_only else None)  # fmt: skip
            return hidden[-1:].view(1, 1, -1) if last_only else hidden.view(b, t, -1)
        n = self.max_rows  # a long prompt: causal prefills of n rows, each over the cache so far
        parts = []
        for i in range(0, t, n):
            chunk = ids[i : i + n]
            # last_only: a chunk before the last leaves its keys and values, no state
            want = None if not last_only else 1 if i + n >= t else 0
            parts.append(self.run_rows(model, chunk, pos[i : i + n], [0] * len(chunk),
                                       out_rows=want))  # fmt: skip
        if last_only:
            return parts[-1][-1:].view(1, 1, -1)
        return torch.cat(parts).view(1, t, -1)

    @property
    def tail_rows(self) -> bool:
        """Whether a prompt that wants only its last rows' states has the step compute the
        last layer for those rows alone (`CpuDecodeStep`'s out_rows): with int8 activations,
        where a row's bits do not depend on the rows beside it (integer sums), so nothing a
        prompt gives moves. fp32 and bf16 GEMVs round a row's sums by the row count (more
        accumulators for fewer rows); there the whole call runs, as before."""
        return self.act_dtype == torch.int8

    @property
    def chunks(self) -> bool:
        """Whether a one-row prefill longer than `max_rows` runs through the step in chunks of
        `max_rows` rather than on the PyTorch layers: with int8 activations, whose tile
        multiplies a 512-row chunk at ~70% of the vpdpbusd peak, far past the dequantize +
        MKL path (Llama-3.2-1B shape, 2048 tokens, 2-core Zen 5: 516 tok/s against 93.6). The
        fp32 and bf16 GEMVs stop winning at `max_rows`, measured where it was set."""
        return self.act_dtype == torch.int8

    def is_current(self) -> bool:
        """True when a step is bound and its cache is still the model's (no new cache since).
        Every cache change replaces all layers' caches together (`setup_cache`, `drop_cache`,
        the serving engine's slot windows), so the first and last layers tell; checking all
        30 of SmolLM2's took 50 us a step."""
        return self.step is not None and all(
            attention.cache is not None and attention.cache.k is k
            for attention, k in (self._caches[0], self._caches[-1])
        )

    def _rope_rows(self, model: CausalLM, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin [R, D] of `positions` [R] (each < the bound cache's slots), from the
        table of every slot's, made at the first step after a larger cache is bound. The
        table's rows are `model.rope`'s values: the same elementwise arithmetic."""
        assert self.step is not None
        if self._rope is None or self._rope[0].shape[0] < self.step.slots:
            every = torch.arange(self.step.slots).unsqueeze(1)
            cos, sin = model.rope(every)
            self._rope = (cos.reshape(self.step.slots, -1), sin.reshape(self.step.slots, -1))
        rows = positions.clamp(0, self._rope[0].shape[0] - 1)  # the step refuses a bad one
        return self._rope[0][rows], self._rope[1][rows]

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
        """Hidden states [R, 1, H] after every layer: token r fed at cache row slots[r]
        (default r) and position positions[r] (see `CpuDecodeStep`), of the cache bound last
        (the caller vouches that it is still the model's). row_invariant: each row exactly as
        a one-row call computes it (speculative decoding's verification). out_rows: only the
        last out_rows rows' states are wanted (`CpuDecodeStep`: the others are not final)."""
        assert self.step is not None
        cos, sin = self._rope_rows(model, torch.tensor(positions))
        x = model.embed(torch.tensor(tokens)).contiguous()
        self.step(x, positions, cos, sin, slots=slots, row_invariant=row_invariant,
                  out_rows=out_rows)  # fmt: skip
        return x.unsqueeze(1)

    def unbound(self) -> CpuDecodePath:
        """A new path with the same settings, bound to nothing yet."""
        return CpuDecodePath(self.act_dtype)


def bf16_activations_faster() -> bool:
    """Whether bf16 activations make this CPU's C step faster than fp32 ones: on AMD CPUs with
    AVX512-BF16, where they were measured faster, not on Intel ones, where they were measured
    slower. SmolLM2 INT4, 2 threads, alternating in one session:
    - Zen 5: prefills and batched steps 1.3-1.45x faster with bf16, batch 1 the same.
    - Intel Xeon (family 6 model 207, AVX512-BF16): the C step took 1.26x (1 row), 1.37x (4),
      1.40x (8) and 1.33x (32 rows) as long with bf16; `generate` decoded 65-77 tok/s against
      81-90 with fp32, and `quantkit bench` cap 8 served 181-236 tok/s against 313-321. The
      likely cause (not profiled): the bf16 tile dequantizes by vpermw lookups."""
    from quantkit.cpu import cpu_vendor

    return bf16_activations_available() and cpu_vendor() == "AuthenticAMD"


def int8_activations_faster() -> bool:
    """Whether int8 activations make this CPU's C step faster than fp32 or bf16 ones: wherever
    the int8 tile builds (AVX512-VNNI), on either vendor. SmolLM2 INT4, 2 threads, rounds of
    128 tokens interleaved in one process:
    - Intel Xeon (family 6 model 207): 108.0 tok/s against 88.9 with fp32 (109.1 against 95.7
      in a later session).
    - AMD EPYC Zen 4 (family 25 model 17, AVX512-VNNI and -BF16), five rounds: 173.8 tok/s
      against 134.1 with bf16 activations (the previous AMD default), both with a bf16 head;
      217.5 with the int8 head too.
    Not measured on Zen 5, where bf16 was tuned. Held-out perplexity +0.12% (16352 tokens,
    `evals.act_precision`). The 16-row int8 tile then made the Zen 4's batch-1 step 3.8 ms
    instead of 5.2 (`evals.decode_phases`)."""
    return int8_activations_available()


def auto_act_dtype(model: CausalLM, *, quantized: bool) -> torch.dtype:
    """For a quantized model whose layers run the C step: int8 where int8 activations were
    measured faster (`int8_activations_faster`), bf16 where bf16 ones were
    (`bf16_activations_faster`), else fp32. Dense models keep fp32, the activations
    transformers computes with."""
    path = model.decode_path
    if quantized and path is not None and path.unsupported(model) is None:
        if int8_activations_faster():
            return torch.int8
        return torch.bfloat16 if bf16_activations_faster() else torch.float32
    return torch.float32


def set_act_dtype(model: CausalLM, dtype: torch.dtype) -> None:
    """Run the C step's GEMVs on `dtype` activations (fp32, bf16 where
    `bf16_activations_available`, int8 where `int8_activations_available`), from the cache
    bound now on."""
    if dtype not in ACT_DTYPES.values():
        raise GenerationError(
            f"activation dtype: expected one of {', '.join(ACT_DTYPES)}, got {dtype}"
        )
    path = model.decode_path
    needs = {  # the narrower activations: what the CPU must have, and the check for it
        torch.bfloat16: ("bfloat16", "AVX512-BF16", bf16_activations_available),
        torch.int8: ("int8", "AVX512-VNNI", int8_activations_available),
    }
    if dtype in needs:
        name, flag, available = needs[dtype]
        why = "no C decode path" if path is None else path.unsupported(model)
        if why is None and not available():
            why = f"a CPU without {flag}"
        if why is not None:
            raise GenerationError(
                f"activation dtype: {name} needs an INT4 model on the C decode step and an "
                f"{flag} CPU, got {why}"
            )
    if path is not None and path.act_dtype != dtype:
        path.act_dtype = dtype
        if path.step is not None:
            path.bind(model)  # the cache bound now, with the new dtype


def enable_cpu_decode(model: CausalLM) -> CpuDecodePath:
    """Attach a CpuDecodePath to `model` (bound at each `setup_cache`)."""
    path = CpuDecodePath()
    model.decode_path = path  # a plain attribute (not a Module): the typed slot `FastPath`
    return path


def pytorch_path_reason(model: CausalLM) -> str | None:
    """Why `model`'s decode steps run on the PyTorch path instead of the one-call C step, in
    one line, or None when the C step runs it (or a GPU runs it, where there is no C step)."""
    if model.device.type != "cpu":
        return None
    if model.decode_path is None:
        return model.config.pytorch_only() or "no C decode step attached"
    return model.decode_path.unsupported(model)
