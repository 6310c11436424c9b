"""The roofline arithmetic of "LLM Inference 101": bytes per token, ceilings, users that fit.

Decode at small batch reads every weight once per step and does 2 FLOPs per weight per sequence,
so its speed is bounded by memory bandwidth: ceiling tok/s = peak bytes/s / bytes read per step,
and MBU (model bandwidth utilization) = achieved tok/s / that ceiling. This module holds that
arithmetic for a model shape (`weight_bytes`, intensities, users that fit) and for a loaded
model (`model_read_bytes`, `decode_roofline`: the bytes its real tensors move). The machines'
peaks live in `quantkit.perf.hardware`, the article's planning questions in
`quantkit.perf.planning`.

Units, chosen to reproduce the article's numbers:
- bandwidth: decimal GB/s (1e9 bytes/s), as vendors publish it; weight and traffic bytes are
  printed in decimal GB too, so "1008 GB/s / 13.5 GB = 74.7 tok/s" reads directly.
- GPU memory: binary GiB. "80GB" of HBM is 80 GiB of power-of-two chips, and the article's
  "60 GB for the cache / 128 KiB per token = ~490,000 tokens" is 60 GiB / 128 KiB = 491,520.
- KV cache per token: KiB (Llama-3.1-70B: 320 KiB).
- FLOP/s: dense (no 2:4 sparsity) tensor-core peaks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from quantkit.errors import GenerationError, ModelSourceError, SchemeError
from quantkit.models.config import moe_config
from quantkit.models.families import family_for
from quantkit.models.family import Family, shape_dims
from quantkit.models.kv_cache import kv_format
from quantkit.models.llama import LLAMA
from quantkit.perf.hardware import GB, Hardware

if TYPE_CHECKING:
    from quantkit.models.decoder import CausalLM

KiB = 2**10


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by where they sit; lm_head is 0 when tied to the embedding."""

    linear: int  # the decoder layers' Linear weights (what quantization compresses)
    embedding: int
    lm_head: int
    other: int  # norms and attention biases

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.lm_head + self.other


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder that decide its bytes and FLOPs; which Linears and norms a
    layer has, and their shapes, are the family's (`Family.linear_dims`, `Family.norms`)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    biases: tuple[str, ...] = ()  # the Linears of a layer with a bias (Qwen2: q/k/v)
    family: Family = LLAMA
    # Mixture of experts: experts per layer and an expert's intermediate size (0: dense). Every
    # expert counts, as stored; a decode step at batch 1 reads only top-k of them, so the
    # bytes per step here are an upper bound for such a model.
    experts: int = 0
    expert_intermediate: int = 0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | Any) -> ModelShape:
        """From an HF config dict (or a transformers config object)."""
        if not isinstance(cfg, Mapping):
            cfg = cfg.to_dict()
        required = {
            "layers": "num_hidden_layers",
            "hidden": "hidden_size",
            "intermediate": "intermediate_size",
            "heads": "num_attention_heads",
            "vocab": "vocab_size",
        }
        values: dict[str, int] = {}
        for field, key in required.items():
            value = cfg.get(key)
            if not isinstance(value, int) or value < 1:
                raise ModelSourceError(
                    f"config: expected {key} as a positive integer (a Llama-family config.json), "
                    f"got {value!r}"
                )
            values[field] = value
        family = family_for(cfg)
        moe = moe_config(cfg, family)
        return cls(
            **values,
            kv_heads=cfg.get("num_key_value_heads") or values["heads"],
            head_dim=cfg.get("head_dim") or values["hidden"] // values["heads"],
            # LlamaConfig's default is untied; the key is present in real config.json files.
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            biases=family.biased(cfg),
            family=family,
            experts=0 if moe is None else moe.experts,
            expert_intermediate=0 if moe is None else moe.intermediate,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        """From a model directory or its config.json."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelSourceError(f"config: expected a config.json file, got nothing at {path}")
        try:
            cfg = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelSourceError(
                f"{path}: expected a JSON object, got unparsable text ({e})"
            ) from e
        if not isinstance(cfg, dict):
            raise ModelSourceError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
        return cls.from_config(cfg)

    def dims(self) -> dict[str, int]:
        """The sizes the family's shapes are given in (`models.family.SHAPE_DIMS`)."""
        return shape_dims(
            hidden=self.hidden, intermediate=self.intermediate, heads=self.heads,
            kv_heads=self.kv_heads, head_dim=self.head_dim,
        )  # fmt: skip

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of each Linear in one decoder layer, in forward order."""
        dims, shapes = self.dims(), self.family.linear_dims
        h, i = self.hidden, self.expert_intermediate
        experts = [(i, h), (i, h), (h, i)] * self.experts  # gate, up, down of each expert
        return [(dims[shapes[n][0]], dims[shapes[n][1]]) for n in self.family.linears] + experts

    @property
    def n_params(self) -> ParamCounts:
        dims = self.dims()
        linear = self.layers * sum(n * k for n, k in self.linear_shapes())
        bias = sum(dims[self.family.linear_dims[n][0]] for n in self.biases)
        norms = sum(dims[size] for size in self.family.norms.values())
        embedding = self.vocab * self.hidden
        return ParamCounts(
            linear=linear,
            embedding=embedding,
            lm_head=0 if self.tied_embeddings else embedding,
            # the MoE router (experts x hidden a layer) stays dense: counted with the norms
            other=self.layers * (norms + bias + self.experts * self.hidden) + self.hidden,
        )


def kv_bytes_per_token(shape: ModelShape, *, dtype_bytes: float = 2) -> int:
    """K and V for every layer: 2 x layers x kv_heads x head_dim x bytes."""
    return int(2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes)


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes by part. `total` is what sits in memory; `read_per_step` what decode reads.

    Decode reads every Linear (packed ints + scales + zero points), the norms and the whole
    lm_head, but from the embedding table only one row per sequence (ignored here: hidden x
    bytes, under 0.01%). A tied lm_head is the embedding matrix, stored once and read in full.
    """

    linear: int  # packed / fp8 / dense Linear weights of the decoder layers
    qparams: int  # scales and zero points
    embedding: int
    lm_head: int  # 0 when tied
    other: int  # norms, biases
    tied: bool
    # Of linear + qparams, the bytes of experts a step does not run (a mixture of experts reads
    # each row's top-k experts only): stored, not read (`model_read_bytes`).
    unread: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.qparams + self.embedding + self.lm_head + self.other

    @property
    def head(self) -> int:
        """Bytes of the output projection read each step (the embedding matrix when tied)."""
        return self.embedding if self.tied else self.lm_head

    @property
    def read_per_step(self) -> int:
        return self.linear + self.qparams + self.other + self.head - self.unread


def _linear_bytes(
    n: int, k: int, *, bits: int, group_size: int, symmetric: bool, dense_bytes: float
) -> tuple[int, int]:
    """(weight bytes, qparam bytes) of one [n, k] Linear in the compressed-tensors layout."""
    if bits == 4:
        groups = 1 if group_size == -1 else math.ceil(k / group_size)
        packed = n * math.ceil(k / 8) * 4  # int32 words, 8 nibbles each
        zeros = 0 if symmetric else math.ceil(n / 8) * groups * 4  # packed along the rows
        return packed, int(n * groups * dense_bytes) + zeros
    if bits == 8:
        return n * k, int(n * dense_bytes)  # fp8 + one scale per output channel
    return n * k * bits // 8, 0


def weight_bytes(
    shape: ModelShape,
    *,
    bits: int,
    group_size: int = 128,
    symmetric: bool = False,
    dense_bytes: float = 2,
) -> WeightBytes:
    """Bytes of the weights with the decoder Linears at `bits`.

    bits: 4 (INT4 group-wise, packed + scales + zero points unless symmetric), 8 (FP8 with a
        per-channel scale), 16 or 32 (dense). Embeddings, lm_head, norms and scales stay at
        `dense_bytes` (the model dtype: 2 for bf16/fp16, 4 for fp32 on a CPU).
    group_size: INT4 input channels per scale; -1 = per output channel.
    """
    if bits not in (4, 8, 16, 32):
        raise SchemeError(f"bits: expected 4, 8, 16 or 32, got {bits}")
    if bits == 4 and not (group_size == -1 or group_size >= 1):
        raise SchemeError(f"group_size: expected a positive size or -1, got {group_size}")
    linear = qparams = 0
    for n, k in shape.linear_shapes():
        w, q = _linear_bytes(
            n, k, bits=bits, group_size=group_size, symmetric=symmetric, dense_bytes=dense_bytes
        )
        linear, qparams = linear + w, qparams + q
    counts = shape.n_params
    return WeightBytes(
        linear=shape.layers * linear,
        qparams=shape.layers * qparams,
        embedding=int(counts.embedding * dense_bytes),
        lm_head=int(counts.lm_head * dense_bytes),
        other=int(counts.other * dense_bytes),
        tied=shape.tied_embeddings,
    )


@dataclass(frozen=True)
class DecodeTraffic:
    """Bytes read by one decode step: the weights once, plus each sequence's KV cache."""

    weights: float
    kv: float
    batch: int
    context: int

    @property
    def total(self) -> float:
        return self.weights + self.kv


def bytes_per_decode_step(
    weight_bytes: float, kv_bytes_per_token: float, *, context: int, batch: int = 1
) -> DecodeTraffic:
    """`weight_bytes` read per step (WeightBytes.read_per_step) + batch x context KV tokens."""
    if context < 0 or batch < 1:
        raise GenerationError(
            f"decode step: expected context >= 0 and batch >= 1, got context={context}, "
            f"batch={batch}"
        )
    return DecodeTraffic(weight_bytes, batch * context * kv_bytes_per_token, batch, context)


def ceiling_tok_s(bandwidth: float, bytes_per_step: float, *, batch: int = 1) -> float:
    """Tokens/s if every step moved its bytes at peak bandwidth (x batch: one token per row)."""
    return batch * bandwidth / bytes_per_step


def mbu(achieved_tok_s: float, ceiling: float) -> float:
    """Model bandwidth utilization: achieved bytes/s over peak = achieved over ceiling tok/s."""
    return achieved_tok_s / ceiling


def kv_budget_bytes(
    memory_bytes: float, weight_bytes: float, *, overhead_fraction: float = 0.05
) -> float:
    """Memory left for the KV cache after the weights and an overhead share (activations, CUDA
    context, fragmentation). 5% reproduces the article: 80 GiB x 0.95 - 16 GiB = 60 GiB."""
    if not 0 <= overhead_fraction < 1:
        raise GenerationError(
            f"overhead_fraction: expected a number in [0, 1), got {overhead_fraction}"
        )
    return max(memory_bytes * (1 - overhead_fraction) - weight_bytes, 0.0)


def users_that_fit(
    memory_bytes: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    context: int,
    *,
    overhead_fraction: float = 0.05,
) -> int:
    """How many sequences of `context` tokens fit their KV cache beside the weights."""
    if context < 1:
        raise GenerationError(f"context: expected >= 1 tokens, got {context}")
    budget = kv_budget_bytes(memory_bytes, weight_bytes, overhead_fraction=overhead_fraction)
    return int(budget // (kv_bytes_per_token * context))


def decode_intensity(batch: int, *, bytes_per_weight: float = 2.0) -> float:
    """FLOP/byte of the decode GEMMs: 2 x batch FLOPs per weight over its bytes.

    The article's approximation: weights dominate the traffic (activations are batch x (n + k)
    elements against n x k weights). 1 at batch 1 in bf16, 2 in fp8, 4 in int4.
    """
    return 2 * batch / bytes_per_weight


def prefill_intensity(
    tokens: int,
    *,
    bytes_per_weight: float = 2.0,
    shape: ModelShape | None = None,
    act_bytes: float = 2,
) -> float:
    """FLOP/byte of the prefill GEMMs over `tokens` tokens.

    Without `shape`: 2 x tokens / bytes_per_weight (weights read once for all tokens). With it,
    each Linear also reads its input and writes its output (tokens x (k + n) x act_bytes), which
    caps the intensity near the layer's smaller dimension. Attention's T^2 work is left out.
    """
    if tokens < 1:
        raise GenerationError(f"prefill tokens: expected >= 1, got {tokens}")
    if shape is None:
        return 2 * tokens / bytes_per_weight
    flops = moved = 0.0
    for n, k in shape.linear_shapes():
        flops += 2 * tokens * n * k
        moved += n * k * bytes_per_weight + tokens * (n + k) * act_bytes
    return flops / moved


# -- a loaded model: the bytes its real tensors move ---------------------------------------------


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def expert_read_share(moe: Any, batch: int = 1) -> float:
    """The share of a mixture-of-experts layer's E experts a decode step of `batch` rows reads
    on average, each row its top k and the router spreading tokens evenly: 1 - (1 - k/E)^batch
    (k/E at one row)."""
    return 1 - (1 - moe.top_k / moe.experts) ** max(batch, 1)


def model_read_bytes(model: CausalLM, *, batch: int = 1) -> WeightBytes:
    """What one decode step of `batch` rows reads from a loaded model's real tensors, by part.

    Compressed Linears count their own bytes (`QuantLinear.weight_bytes()`: packed ints or fp8,
    scales, zero points, bias), split into the packed weight and the rest; dense Linears their
    weight (and bias); norms their weight. The embedding table is stored but decode reads one
    row of it per sequence, so it counts in `embedding` (memory) only, unless it is also the
    tied lm_head, which reads it in full. A tensor shared by two modules counts once.

    A mixture of experts runs each row's top-k experts only (the C step reads no other): of a
    layer's E experts, a step of one row reads k, and of `batch` rows E (1 - (1 - k/E)^batch)
    on average when the router spreads tokens evenly. The rest is `unread`.
    """
    linear = qparams = other = 0
    moe = model.config.moe
    expert_bytes = 0
    seen: set[int] = set()

    def fresh(t: Any) -> bool:
        # Tied or aliased tensors are read once per step, not once per module holding them.
        key = t.data_ptr()
        if key in seen:
            return False
        seen.add(key)
        return True

    for where, module in model.model.layers.named_modules():
        in_expert = ".experts." in where
        if hasattr(module, "weight_bytes"):  # QuantLinear, duck-typed: no import upward needed
            main = getattr(module, "weight_packed", None)
            main = module.weight if main is None else main
            bias = module.bias
            extra = 0 if bias is None else _nbytes(bias)
            linear += _nbytes(main)
            other += extra
            qparams += module.weight_bytes() - _nbytes(main) - extra
            expert_bytes += module.weight_bytes() - extra if in_expert else 0
            continue
        for name, p in module.named_parameters(recurse=False):
            if not fresh(p):
                continue
            if isinstance(module, nn.Linear) and name == "weight":
                linear += _nbytes(p)
                expert_bytes += _nbytes(p) if in_expert else 0
            else:
                other += _nbytes(p)
    unread = 0
    if moe is not None and expert_bytes:
        read = moe.experts * expert_read_share(moe, batch)
        unread = round(expert_bytes * (1 - read / moe.experts))
    other += _nbytes(model.model.norm.weight)
    embed = model.model.embed_tokens.weight
    if hasattr(model.lm_head, "weight_bytes"):  # a quantized head: its packed weight and scales
        head_bytes, tied = model.lm_head.weight_bytes(), False
    else:
        head = model.lm_head.weight
        tied = head.data_ptr() == embed.data_ptr()
        head_bytes = 0 if tied else _nbytes(head)
    return WeightBytes(
        linear=linear,
        qparams=qparams,
        embedding=_nbytes(embed),
        lm_head=head_bytes,
        other=other,
        tied=tied,
        unread=unread,
    )


def model_kv_bytes_per_token(model: CausalLM) -> int:
    """K and V bytes one token adds to the cache of a loaded model, in the cache's format
    (`model.kv_dtype`: int8 and fp8 hold head_dim codes and a 4-byte scale per head)."""
    cfg = model.config
    head = kv_format(model.kv_dtype, model.dtype).bytes_per_head(cfg.head_dim)
    return 2 * cfg.num_layers * cfg.num_kv_heads * head


@dataclass(frozen=True)
class DecodeRoofline:
    """A measured decode rate against the ceiling of the machine it ran on.

    bytes_per_token is the step's traffic over the batch (the weights are read once per step
    for every row together), so ceiling_tok_s = bandwidth / bytes_per_token for the batch.
    """

    weights: WeightBytes
    traffic: DecodeTraffic
    hardware: Hardware
    achieved_tok_s: float  # summed over the batch

    @property
    def bytes_per_token(self) -> float:
        return self.traffic.total / self.traffic.batch

    @property
    def ceiling_tok_s(self) -> float:
        return ceiling_tok_s(self.hardware.bandwidth, self.traffic.total, batch=self.traffic.batch)

    @property
    def mbu(self) -> float:
        return mbu(self.achieved_tok_s, self.ceiling_tok_s)

    def to_dict(self) -> dict[str, Any]:
        w = self.weights
        return {
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_step": self.traffic.total,
            "bytes_linear": w.linear,
            "bytes_qparams": w.qparams,
            "bytes_lm_head": w.head,
            "bytes_other": w.other,
            "bytes_kv": self.traffic.kv,
            "kv_context": self.traffic.context,
            "peak_gb_s": self.hardware.bandwidth / GB,
            # Where the peak came from: a datasheet, or this CPU's probe (when, how, how busy).
            "bandwidth_source": self.hardware.source,
            "ceiling_tok_s": self.ceiling_tok_s,
            "mbu": self.mbu,
        }


def decode_roofline(
    model: CausalLM,
    *,
    achieved_tok_s: float,
    context: int,
    hardware: Hardware,
    batch: int = 1,
) -> DecodeRoofline:
    """The roofline of `model`'s decode at `context` tokens of cache per row (use the mean
    context over the measured steps) and `batch` rows, from its real tensors."""
    weights = model_read_bytes(model, batch=batch)
    traffic = bytes_per_decode_step(
        weights.read_per_step, model_kv_bytes_per_token(model), context=context, batch=batch
    )
    return DecodeRoofline(weights, traffic, hardware, achieved_tok_s)
