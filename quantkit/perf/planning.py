"""The article's planning questions for one model on one machine: `plan` and `format_plan`.

Given a model shape (a config.json, the embedded model, or a well-known model by name from a
small built-in table, so planning needs no weights) and a machine (a GPU from the table or this
CPU measured): weight bytes, KV bytes per token, how many users of a context fit, arithmetic
intensity of decode and prefill against the ridge point, and the decode ceiling. The arithmetic
itself is `quantkit.perf.roofline`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import GenerationError, ModelSourceError
from quantkit.perf.hardware import GB, TFLOPS, GiB, Hardware, lookup_gpu, ridge_point
from quantkit.perf.roofline import (
    DecodeTraffic,
    KiB,
    ModelShape,
    ParamCounts,
    WeightBytes,
    bytes_per_decode_step,
    ceiling_tok_s,
    decode_intensity,
    kv_budget_bytes,
    kv_bytes_per_token,
    prefill_intensity,
    users_that_fit,
    weight_bytes,
)


def _llama(
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    *,
    tied: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "tie_word_embeddings": tied, **extra,
    }  # fmt: skip


# The config.json fields that decide bytes and FLOPs, copied from the models' published configs,
# so `quantkit roofline llama-3.1-70b` plans without downloading 140 GB of weights.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": _llama(30, 576, 1536, 9, 3, 49152, tied=True),
    "llama-3.2-1b": _llama(16, 2048, 8192, 32, 8, 128256, tied=True),
    "llama-3.2-3b": _llama(28, 3072, 8192, 24, 8, 128256, tied=True),
    "llama-3.1-8b": _llama(32, 4096, 14336, 32, 8, 128256),
    "llama-3.1-70b": _llama(80, 8192, 28672, 64, 8, 128256),
    "llama-2-7b": _llama(32, 4096, 11008, 32, 32, 32000),
    "llama-2-13b": _llama(40, 5120, 13824, 40, 40, 32000),
    "mistral-7b": _llama(32, 4096, 14336, 32, 8, 32000, model_type="mistral"),
    "qwen2.5-7b": _llama(28, 3584, 18944, 28, 4, 152064, model_type="qwen2"),
}


def resolve_shape(spec: str | Path) -> tuple[str, ModelShape]:
    """(display name, shape) for MODEL: a model directory or config.json path, or a name from
    `KNOWN_MODELS` (case-insensitive)."""
    path = Path(spec).expanduser()
    if path.exists():
        name = path.parent.name if path.is_file() else path.name
        return name, ModelShape.from_file(path)
    key = str(spec).strip().lower()
    if key in KNOWN_MODELS:
        return key, ModelShape.from_config(KNOWN_MODELS[key])
    raise ModelSourceError(
        f"MODEL {str(spec)!r}: expected a model directory, a config.json, or one of "
        f"{', '.join(KNOWN_MODELS)}, got a path that does not exist"
    )


# -- the article's planning questions for one model on one machine ----------------------------


@dataclass(frozen=True)
class PlanReport:
    """What `plan()` found; `format_plan` prints it."""

    model: str
    hardware: Hardware
    bits: int
    group_size: int
    params: ParamCounts
    weights: WeightBytes
    kv_bytes_per_token: int
    context: int
    users: int
    kv_budget_bytes: float  # memory left for the cache after weights and overhead
    users_that_fit: int  # at `context` tokens each
    traffic: DecodeTraffic  # one decode step at `batch` x `context`
    ceiling_tok_s: float  # per sequence; the batch gets batch x this
    weights_ceiling_tok_s: float  # batch 1, empty cache: the article's bandwidth / weight bytes
    decode_intensity: float  # of the Linears at `batch` (attention over the KV cache stays ~1)
    prefill_tokens: int
    prefill_intensity: float
    ridge_point: float | None  # bf16 tensor peak; None where no FLOP/s peak is known

    @property
    def kv_bytes_for_users(self) -> int:
        return self.users * self.context * self.kv_bytes_per_token

    @property
    def users_fit(self) -> bool:
        return self.users <= self.users_that_fit

    @property
    def kv_tokens_that_fit(self) -> int:
        return int(self.kv_budget_bytes // self.kv_bytes_per_token)


def plan(
    shape: ModelShape,
    *,
    hardware: Hardware | str,
    model: str = "model",
    bits: int = 16,
    group_size: int = 128,
    symmetric: bool = False,
    dense_bytes: float = 2,
    kv_dtype_bytes: float = 2,
    context: int = 8192,
    users: int = 1,
    batch: int = 1,
    prefill_tokens: int | None = None,
    overhead_fraction: float = 0.05,
) -> PlanReport:
    """Weight bytes, KV bytes per token, users that fit at `context`, decode (at `batch`) and
    prefill (at `prefill_tokens`, default `context`) intensity vs the ridge point, ceiling tok/s.

    hardware: a Hardware (e.g. `local_hardware("cpu")`) or a GPU name from the table.
    """
    if isinstance(hardware, str):
        hardware = lookup_gpu(hardware)
    if users < 1 or batch < 1 or context < 1:
        raise GenerationError(
            f"plan: expected users, batch and context >= 1, got users={users}, batch={batch}, "
            f"context={context}"
        )
    weights = weight_bytes(
        shape, bits=bits, group_size=group_size, symmetric=symmetric, dense_bytes=dense_bytes
    )
    params = shape.n_params
    kv_token = kv_bytes_per_token(shape, dtype_bytes=kv_dtype_bytes)
    # Bytes per compressed weight, scales and zero points included (0.52 for INT4 g128).
    per_weight = (weights.linear + weights.qparams) / params.linear
    traffic = bytes_per_decode_step(weights.read_per_step, kv_token, context=context, batch=batch)
    tokens = prefill_tokens or context
    return PlanReport(
        model=model,
        hardware=hardware,
        bits=bits,
        group_size=group_size,
        params=params,
        weights=weights,
        kv_bytes_per_token=kv_token,
        context=context,
        users=users,
        kv_budget_bytes=kv_budget_bytes(
            hardware.memory_bytes, weights.total, overhead_fraction=overhead_fraction
        ),
        users_that_fit=users_that_fit(
            hardware.memory_bytes,
            weights.total,
            kv_token,
            context,
            overhead_fraction=overhead_fraction,
        ),
        traffic=traffic,
        ceiling_tok_s=ceiling_tok_s(hardware.bandwidth, traffic.total),
        weights_ceiling_tok_s=ceiling_tok_s(hardware.bandwidth, weights.read_per_step),
        decode_intensity=decode_intensity(batch, bytes_per_weight=per_weight),
        prefill_tokens=tokens,
        prefill_intensity=prefill_intensity(
            tokens, bytes_per_weight=per_weight, shape=shape, act_bytes=dense_bytes
        ),
        ridge_point=ridge_point(hardware) if hardware.bf16_flops else None,
    )


def _gb(n: float) -> str:
    return f"{n / GB:.3f} GB"


def _bound(intensity: float, ridge: float | None) -> str:
    if ridge is None:
        return "no FLOP/s peak known"
    return f"{'compute' if intensity >= ridge else 'memory'}-bound (ridge {ridge:.0f})"


def format_plan(report: PlanReport) -> str:
    """A two-column table a person can read at a glance."""
    r, hw, w, t = report, report.hardware, report.weights, report.traffic
    weights_kind = {4: f"INT4 g{r.group_size}", 8: "FP8", 16: "16-bit", 32: "fp32"}[r.bits]
    flops = f", bf16 {hw.bf16_flops / TFLOPS:.0f} TFLOP/s" if hw.bf16_flops else ""
    step = t.total
    head_name = "lm_head (tied)" if w.tied else "lm_head"
    rows = [
        ("hardware", f"{hw.name}: {hw.bandwidth / GB:.0f} GB/s, {hw.memory_bytes / GiB:.0f} GiB"
         f"{flops} ({hw.source})"),
        ("parameters", f"{r.params.total / 1e9:.3f} B ({r.params.linear / 1e9:.3f} B in Linears)"),
        (f"weights in memory ({weights_kind})", _gb(w.total)),
        ("KV cache per token", f"{r.kv_bytes_per_token / KiB:.1f} KiB"),
        (f"KV for {r.users} user(s) x {r.context} tokens",
         f"{r.kv_bytes_for_users / GiB:.2f} GiB: {'fits' if r.users_fit else 'does NOT fit'}"),
        ("memory left for the KV cache", f"{r.kv_budget_bytes / GiB:.2f} GiB"
         f" = {r.kv_tokens_that_fit:,} tokens"),
        (f"concurrent users at {r.context} tokens", f"{r.users_that_fit}"),
        (f"read per decode step (batch {t.batch})", _gb(step)),
        ("  decoder Linears", f"{_gb(w.linear)} ({w.linear / step:.1%})"),
        ("  scales + zero points", f"{_gb(w.qparams)} ({w.qparams / step:.1%})"),
        (f"  {head_name}", f"{_gb(w.head)} ({w.head / step:.1%})"),
        ("  norms + biases", f"{_gb(w.other)} ({w.other / step:.1%})"),
        (f"  KV cache at {t.context} tokens", f"{_gb(t.kv)} ({t.kv / step:.1%})"),
        ("decode ceiling, weights only", f"{r.weights_ceiling_tok_s:.1f} tok/s (batch 1)"),
        (f"decode ceiling, batch {t.batch} at {t.context}",
         f"{r.ceiling_tok_s:.1f} tok/s per sequence, "
         f"{t.batch * r.ceiling_tok_s:.1f} tok/s for the batch"),
        (f"decode intensity, Linears (batch {t.batch})",
         f"{r.decode_intensity:.2f} FLOP/byte: {_bound(r.decode_intensity, r.ridge_point)}"),
        (f"prefill intensity ({r.prefill_tokens} tokens)",
         f"{r.prefill_intensity:.0f} FLOP/byte: {_bound(r.prefill_intensity, r.ridge_point)}"),
    ]  # fmt: skip
    width = max(len(label) for label, _ in rows)
    lines = [f"roofline: {r.model}"] + [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
