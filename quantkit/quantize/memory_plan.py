"""How much memory a streamed quantization will need at its peak, known before it starts.

The peak is the runtime (interpreter, torch, the tokenizer and text when loaded) plus the
largest of the phases' working sets:

- a decoder layer: the layer in fp32 and its rounding temporaries; with calibration the
  activations (fp32, four copies at once), the calibration embedding rows, one chunk's forward
  and the algorithm's own state (AWQ: its captured inputs, searches and clip errors; GPTQ: an
  fp64 Hessian per input group and one factorization);
- the outer tensors, one at a time: the embedding read (with its NaN mask, or converted to the
  storage dtype), a quantized head rounded, on top of what the layer walk left in the heap;
- the perplexity before and after (`--eval-tokens`): the whole model in fp32, what its loading
  or the layer walk left in the heap, a batch of windows' logits over the vocabulary and one
  window's log-probabilities.

All of it from the tensors' headers and the config, no weight read. Each term names the
measurement that sized it (RSS sampled every 20 ms, phases marked; MiB). The figures are upper
bounds: on every run measured the peak sat at 0.7-0.95 of the estimate. A run whose estimate
exceeds the memory available is refused up front, naming the phase that needs the most and the
option that lowers it, instead of an allocation failing an hour in.

Freed memory does not all go back to the system: blocks under glibc's mmap threshold (up to
32 MiB) are kept in the heap for reuse, so a phase finds the heap the one before it left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.errors import QuantkitError, SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.algorithms import ALGORITHMS
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.moe import expert_linears, moe_input_groups
from quantkit.quantize.pipeline import quantized_linears, storage_dtype
from quantkit.quantize.source_model import EMBED, SourceModel

MIB = 2**20
# The interpreter, torch and quantkit with the model's shell on the meta device: measured
# 375-405 MiB when the layer walk starts (SmolLM2-135M, a Qwen3-1.7B shape).
RUNTIME_BYTES = 420 * MIB
# The tokenizer, loaded for calibration and for perplexity: transformers' import and the
# tokenizer's tables, measured +81 MiB for SmolLM2's 3.5 MB tokenizer.json.
TOKENIZER_BYTES = 24 * MIB
TOKENIZER_PER_FILE_BYTE = 20
# The bundled articles and their token ids (calibration and held-out text): measured +74 MiB.
TEXT_BYTES = 80 * MIB
# The perplexity the quantize command scores with: windows of 512 tokens, 4 to a batch.
PERPLEXITY_WINDOW = 512
PERPLEXITY_BATCH = 4
# glibc serves blocks under its mmap threshold (which rises to 32 MiB) from the heap, keeps
# them when freed and fragments: the heap-sized part of a working set grows by up to half
# again (the RTN walk of a Qwen3-1.7B shape: 437 MiB over the runtime on layer 0, 792 by
# layer 4). Blocks above the threshold are mapped, and unmapped when freed.
MMAP_THRESHOLD = 32 * MIB
FRAGMENTATION = 1.5
# The share of the layer phase the walk may leave in the heap (see `plan_memory`).
LEFT_ROUNDED = 0.5
LEFT_CALIBRATED = 0.75
AWQ_GROUP = 32  # the smallest group: the most clip-search groups, when the scheme is not given
_V1 = "/sys/fs/cgroup/memory/memory."  # cgroup v1's memory controller


class InsufficientMemoryError(QuantkitError):
    """The machine has less memory available than the run is estimated to need."""

    exit_code = 5


@dataclass(frozen=True)
class MemoryPlan:
    phases: dict[str, int]  # phase -> estimated bytes on top of the runtime
    remedies: dict[str, str]  # phase -> the option that lowers it
    runtime: int = RUNTIME_BYTES  # the interpreter and libraries, the tokenizer and text

    @property
    def peak(self) -> int:
        return self.runtime + max(self.phases.values())

    @property
    def largest(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])


def plan_memory(
    source: SourceModel,
    *,
    calibrated: str | None,  # the calibrated algorithm's name ("awq", "gptq", ...) or None
    samples: int,
    seq_len: int,
    quantize_head: bool,
    score: bool,
    awq: AwqConfig | None = None,
    gptq: GptqConfig | None = None,
    scheme: QuantScheme | None = None,  # for the group size AWQ's clip search uses
) -> MemoryPlan:
    """The estimated working set of each phase of a streamed run of `source`."""
    shell = source.shell
    numels = [_layer_numel(source, i) for i in range(shell.config.num_layers)]
    index = max(range(len(numels)), key=numels.__getitem__, default=0)
    layer = _LayerShapes(shell.model.layers[index], numels[index] if numels else 0, source, index)
    rounding = layer.rounding
    live = layer.fixed + rounding
    heap = layer.small + (rounding if layer.rounding_in_heap else 0)
    remedies = {"decoder layer": "a machine with more memory"}
    if calibrated:
        parts = ALGORITHMS[calibrated].configs if calibrated in ALGORITHMS else (calibrated,)
        group = _group_size(source, scheme)
        kept, kept_heap, passes = _calibrated(layer, parts, samples, seq_len, awq or AwqConfig(),
                                              gptq or GptqConfig(), group)  # fmt: skip
        # The passes run one after another, the rounding among them; their temporaries are
        # counted heap-sized (chunks, searches: the measured layer phases need it).
        step = max(rounding, *passes)
        live = layer.fixed + kept + step
        heap = layer.small + kept_heap + step
        remedies["decoder layer"] = f"fewer calibration windows (--calib-samples, now {samples})"
    walk = live + int((FRAGMENTATION - 1) * heap)
    phases = {"decoder layer": walk}
    # What the walk leaves in the heap, found by the phases after it. Measured over the
    # runtime when the embedding is read: 390 MiB after the RTN walk of a Qwen3-1.7B shape
    # (layer phase 870 estimated), 9 after a Llama-3.1-8B one (2964: its big tensors are
    # mapped, and unmapped when freed), 4130 after a Qwen3-30B-A3B one (4817: small expert
    # tensors, which the heap keeps whole); 434 after SmolLM2's AWQ walk and 674 after its
    # GPTQ walk (905 and 953: chunks and captures are heap-sized too).
    share = LEFT_CALIBRATED if calibrated else LEFT_ROUNDED
    left = max(int(share * walk), int(FRAGMENTATION * layer.small))
    outer = _outer(source, quantize_head)
    phases["embedding and head"] = left + outer
    remedies["embedding and head"] = "a machine with more memory"
    if quantize_head:
        remedies["embedding and head"] = "--dense-head"
    if left > outer:  # the walk's leftovers weigh more: what lowers the walk lowers them
        remedies["embedding and head"] = remedies["decoder layer"]
    if score:
        phases["perplexity"] = _perplexity(source, left)
        remedies["perplexity"] = "--eval-tokens 0 (no perplexity before and after)"
    runtime = RUNTIME_BYTES
    if calibrated or score:
        runtime += _tokenizer_and_text(source)
    return MemoryPlan(phases, remedies, runtime)


@dataclass(frozen=True)
class _LayerShapes:
    """The largest decoder layer's sizes, from the meta shell and the headers."""

    module: nn.Module  # the shell's layer (meta device)
    numel: int
    source: SourceModel
    index: int

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Each Linear's (out, in) features by layer-relative name."""
        return {
            name: (m.out_features, m.in_features)
            for name, m in self.module.named_modules()
            if isinstance(m, nn.Linear)
        }

    @property
    def widest(self) -> int:
        return max((n * k for n, k in self.linears.values()), default=0)

    @property
    def small(self) -> int:
        """The bytes of the Linears whose fp32 copy is heap-sized (read, fp32, rounded)."""
        return 5 * sum(n * k for n, k in self.linears.values() if 4 * n * k < MMAP_THRESHOLD)

    @property
    def fixed(self) -> int:
        """The layer in fp32, the largest tensor read in its own dtype, and the rounded
        tensors (at most a byte a parameter: 8-bit codes, or 4-bit ones with their scales)."""
        prefix = f"model.layers.{self.index}."
        entries = self.source.files.entries
        largest = max((e.nbytes for k, e in entries.items() if k.startswith(prefix)), default=0)
        return 5 * self.numel + largest

    @property
    def rounding(self) -> int:
        """Round to nearest's temporaries, a block of 1024 rows at a time (`round_and_store`):
        measured 5.7-5.9x the fp32 bytes of 2048x6144 to 14336x4096 Linears; 8x bounds it.
        With the layer, measured over the runtime and estimated: +792 MiB at a Qwen3-1.7B
        shape (870), +2021 at Llama-3.1-8B's (2964), +4285 at Qwen3-30B-A3B's (4817), +41
        at SmolLM2-135M (68)."""
        return 8 * 4 * self.widest

    @property
    def rounding_in_heap(self) -> bool:
        """Whether the blocks are heap-sized: every Linear's input under 8192 wide."""
        k_max = max((k for _, k in self.linears.values()), default=0)
        return 4 * 1024 * k_max < MMAP_THRESHOLD


def _calibrated(
    layer: _LayerShapes,
    parts: tuple[str, ...],
    samples: int,
    seq_len: int,
    awq: AwqConfig,
    gptq: GptqConfig,
    group: int,
) -> tuple[int, int, list[int]]:
    """What calibration adds to a decoder layer's working set, fp32 throughout (the shell's
    dtype): the bytes kept through the step, the heap-sized part of them, and each pass's
    temporaries. With the layer, measured over the runtime and estimated: SmolLM2-135M +818
    MiB with AWQ's 64 x 512 tokens (905), +353 with 8 x 512 (446), +891 with GPTQ's 128 x 512
    (953)."""
    cfg = layer.source.shell.config
    h, vocab = cfg.hidden_size, cfg.vocab_size
    inner = max(cfg.intermediate_size or 0, h)
    tokens = samples * seq_len
    # The activations entering the layer, the walk's own first ones (`LayerWalk.x`, held to
    # the end), the chunks leaving it and their concatenation: four copies at once.
    live = 4 * 4 * tokens * h
    live += 4 * min(vocab, tokens) * h  # the calibration text's embedding rows in the shell
    heap, passes = 0, []
    # A combination (awq+gptq) holds AWQ's captures while GPTQ's Hessians are made: both.
    if "awq" in parts:
        search = min(awq.search_tokens, tokens)
        seqs = max(1, min(samples, search // seq_len)) * seq_len
        # The captures, and the search sequences' inputs and the layer's outputs on them.
        heap += _awq_captures(layer, tokens, awq) + 3 * 4 * seqs * h
        passes += [
            # A chunk's forward (the MLP's intermediates) and the capture hooks' |x|.
            4 * 4 * min(awq.batch_sequences, samples) * seq_len * inner,
            # The RTN baseline: a rounded copy of the whole layer, run on the search sequences.
            4 * layer.numel + 3 * 4 * min(awq.batch_sequences, seqs) * inner,
            # The scale search: the inspected module on the search tokens, and scaled and
            # rounded copies of the widest Linears.
            3 * 4 * search * inner + 6 * 4 * layer.widest,
            # The clip search's error per (group, token, output channel) and its square.
            2 * 4 * awq.clip_tokens * layer.widest // group + 2 * 4 * layer.widest,
        ]
    if "awq" not in parts or "gptq" in parts:
        groups = [*layer.source.shell.family.input_groups,
                  *moe_input_groups(layer.source.shell)]  # fmt: skip
        linears = layer.linears
        # Each input group's (input features, stacked output rows).
        shapes = [
            (linears[g[0]][1], sum(linears[n][0] for n in g if n in linears))
            for g in groups
            if g[0] in linears
        ]
        live += 8 * sum(k * k for k, _ in shapes)  # fp64 Hessians, all held at once
        passes.append(3 * 4 * min(gptq.batch_sequences, samples) * seq_len * inner)
        # One group rounded: its H scaled, permuted, damped and factored (six fp64 copies at
        # once, the factor in fp32 too) and its stacked rows, their rounded, stored and
        # nearest copies in fp32.
        passes += [52 * k * k + 8 * 4 * rows * k for k, rows in shapes]
    return live + heap, heap, passes


def _awq_captures(layer: _LayerShapes, tokens: int, awq: AwqConfig) -> int:
    """Each Linear's captured inputs on the search tokens (an expert's: the tokens routed to
    it, at most `search_tokens`), and one Linear's twice more while a fold divides them and
    the search concatenates them."""
    cfg = layer.source.shell.config
    search = min(awq.search_tokens, tokens)
    routed = expert_linears(layer.source.shell)
    widths = {name: k for name, (_, k) in layer.linears.items()}
    dense = sum(k for name, k in widths.items() if name not in routed)
    experts = sum(k for name, k in widths.items() if name in routed)
    if cfg.moe is not None and experts:
        experts = int(experts * min(1.0, tokens * cfg.moe.top_k / (cfg.moe.experts * search)))
    return 4 * search * (dense + experts + 2 * max(widths.values(), default=0))


def _outer(source: SourceModel, quantize_head: bool) -> int:
    """The embedding (and an untied head) read and stored, one at a time: in the storage
    dtype already, plus the bool NaN mask checked before it is kept as read (measured: the
    Qwen3-1.7B shape's 593 MiB bf16 embedding raised the RSS by 862 MiB); else read and
    converted a chunk at a time into a new tensor."""
    embed = source.files.entries[EMBED]
    numel = math.prod(embed.shape)
    stored = storage_dtype(source.config)
    if embed.dtype == stored:
        dense = embed.nbytes + numel
    else:
        dense = embed.nbytes + numel * stored.itemsize + min(numel, 1 << 24) * (4 + 4)
    if quantize_head:  # the head read, in fp32, rounded (not measured)
        return max(dense, embed.nbytes + 3 * 4 * numel)
    return dense


def _perplexity(source: SourceModel, left: int) -> int:
    """The whole model in fp32 scored a batch of windows at a time. Measured over the loaded
    model during the scoring when three batches of logits lived at once: +1155 MiB on
    SmolLM2-135M (49152-token vocabulary: 3 x 384 MiB of logits), +3785 on a Qwen3-1.7B shape
    (151936: 3 x 1187), +8178 on a Gemma-2-2B one (256000 and a final soft-cap: 4 x 1953).
    Now one batch and a window's log-probabilities: a 4-layer Gemma-2-2B shape's RTN run with
    4096 held-out tokens peaks at 7848 MiB (12312 before; estimated 8664). The reference
    model's loading: +857 MiB on SmolLM2 (its bf16 state, the fp32 model, a second fp32 copy
    of the tied head before it is tied)."""
    cfg = source.shell.config
    entries = source.files.entries
    params = sum(math.prod(e.shape) for e in entries.values())
    embed = math.prod(entries[EMBED].shape)
    state = sum(e.nbytes for e in entries.values())
    converted = any(e.dtype != torch.float32 for e in entries.values())
    model = 4 * params
    load = model + (state + (4 * embed if cfg.tie_word_embeddings else 0) if converted else 0)
    # What the source's tensors (read whole, then freed) or the layer walk left in the heap;
    # the model's tensors under the mmap threshold are allocated into the walk's first.
    small = sum(4 * n for n in map(math.prod, (e.shape for e in entries.values()))
                if 4 * n < MMAP_THRESHOLD)  # fmt: skip
    heap = max(state if converted else 0, left - small)
    logits = PERPLEXITY_BATCH * PERPLEXITY_WINDOW * cfg.vocab_size * 4
    # The batch's logits (a final soft-cap is taken in place) and one window's
    # log-probabilities (`perplexity` takes them a row at a time).
    logits += logits // PERPLEXITY_BATCH
    tokens = PERPLEXITY_BATCH * PERPLEXITY_WINDOW
    inner = max(cfg.intermediate_size or 0, cfg.hidden_size)
    forward = 4 * tokens * (4 * cfg.hidden_size + 3 * inner)
    # Attention scores where they are materialized (soft-capped: the logits, tanh, mask,
    # softmax), one batch's.
    scores = 4 * PERPLEXITY_BATCH * cfg.num_heads * PERPLEXITY_WINDOW**2
    forward += scores * (4 if cfg.attn_softcap is not None else 1)
    return max(load, model + heap + logits + forward)


def _tokenizer_and_text(source: SourceModel) -> int:
    """The tokenizer (sized by its file) and the bundled text with its token ids."""
    files = [source.model_dir / n for n in ("tokenizer.json", "tokenizer.model")]
    size = max((f.stat().st_size for f in files if f.is_file()), default=0)
    return TOKENIZER_BYTES + TOKENIZER_PER_FILE_BYTE * size + TEXT_BYTES


def _group_size(source: SourceModel, scheme: QuantScheme | None) -> int:
    """The group size the scheme resolves to on this model (the smallest when unknown)."""
    if scheme is None:
        return AWQ_GROUP
    try:
        resolved = scheme.resolve(quantized_linears(source.shell))
    except SchemeError:
        return AWQ_GROUP
    if resolved.group_size == -1:
        return max((k for _, k in quantized_linears(source.shell)), default=AWQ_GROUP)
    return int(resolved.group_size)


def available_bytes() -> int | None:
    """Memory this process can still use: MemAvailable, under a cgroup limit if lower (None
    where neither can be read)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            cap, used = _read_int(limit), _read_int(usage)
        except (OSError, ValueError):
            continue
        if cap is not None and used is not None and cap < 2**60:
            found.append(max(0, cap - used))
    return min(found) if found else None


def check_memory(plan: MemoryPlan, *, available: int | None = None) -> None:
    """Refuse a run estimated to need more than the memory available, with both numbers."""
    available = available_bytes() if available is None else available
    if available is None or plan.peak <= available:
        return
    phase = plan.largest
    raise InsufficientMemoryError(
        f"memory: expected at most {_gb(available)} available to be enough, got an estimated "
        f"peak of {_gb(plan.peak)} ({phase}: {_gb(plan.phases[phase])}); "
        f"{plan.remedies[phase]} lowers it"
    )


def _layer_numel(source: SourceModel, index: int) -> int:
    prefix = f"model.layers.{index}."
    return sum(math.prod(e.shape) for k, e in source.files.entries.items() if k.startswith(prefix))


def _read_int(path: str) -> int | None:
    text = open(path).read().strip()  # noqa: SIM115 - a one-line sysfs file
    return None if text == "max" else int(text)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
