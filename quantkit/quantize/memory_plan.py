"""How much memory a streamed quantization will need at its peak, known before it starts.

The streaming pipeline holds one phase's working set at a time, so the peak is the largest of:

- a decoder layer: the layer in fp32, the largest Linear's round-to-nearest temporaries, and
  with calibration the activations entering and leaving it plus the algorithm's own state
  (AWQ: the captured inputs of its search tokens and one chunk's forward; GPTQ: the Hessians
  of a layer's input groups and their factorization);
- the outer tensors, one at a time: the embedding read (and converted, when the storage dtype
  differs from the source's; a quantized head: the head in fp32, rounded);
- the perplexity before and after (`--eval-tokens`): the whole model in fp32, twice.

All of it from the tensors' headers and the config, no weight read. The figures are upper
estimates from the shapes (the measured peaks of the benchmarks in the README sit below them);
a run whose estimate exceeds the memory available is refused up front, naming the phase that
needs the most and the option that lowers it, instead of an allocation failing an hour in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.quantize.algorithms import ALGORITHMS
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import storage_dtype
from quantkit.quantize.source_model import EMBED, SourceModel

# Python, torch and the tokenizer before any tensor (measured ~350 MB; rounded up).
RUNTIME_BYTES = 450 * 2**20
_V1 = "/sys/fs/cgroup/memory/memory."  # cgroup v1's memory controller


class InsufficientMemoryError(QuantkitError):
    """The machine has less memory available than the run is estimated to need."""

    exit_code = 5


@dataclass(frozen=True)
class MemoryPlan:
    phases: dict[str, int]  # phase -> estimated bytes on top of the runtime
    remedies: dict[str, str]  # phase -> the option that lowers it

    @property
    def peak(self) -> int:
        return RUNTIME_BYTES + max(self.phases.values())

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
) -> MemoryPlan:
    """The estimated working set of each phase of a streamed run of `source`."""
    cfg = source.shell.config
    entries = source.files.entries
    layer_params = max(
        (_layer_numel(source, i) for i in range(cfg.num_layers)), default=0
    )  # fmt: skip
    linears = [
        e.shape
        for k, e in entries.items()
        if k.startswith("model.layers.") and k.endswith(".weight") and len(e.shape) == 2
    ]
    widest = max((n * k for n, k in linears), default=0)
    # Round to nearest's temporaries (a block of rows at a time, `round_and_store`, but the
    # allocator keeps what the blocks freed): measured at Llama-3.1-8B's shape, 1491 MiB past
    # the layer for a 235 MB widest Linear; 8x its fp32 bytes bounds it.
    layer = 4 * layer_params + 8 * 4 * widest
    remedies = {"decoder layer": "a machine with more memory"}
    if calibrated:
        h = cfg.hidden_size
        inner = max(cfg.intermediate_size or 0, h)
        tokens = samples * seq_len
        layer += 2 * 4 * tokens * h  # the activations entering and leaving the layer
        # A combination (awq+gptq) holds AWQ's captures while GPTQ's Hessians are made: both.
        parts = ALGORITHMS[calibrated].configs if calibrated in ALGORITHMS else (calibrated,)
        if "awq" in parts:
            a = awq or AwqConfig()
            layer += 4 * min(a.search_tokens, tokens) * (3 * h + inner)  # captured inputs
            layer += 3 * 4 * min(a.batch_sequences, samples) * seq_len * inner  # one chunk
            # The RTN baseline holds a rounded copy of the whole layer beside the original, and
            # the scale search several scaled and rounded copies of the widest Linears. Measured
            # at Llama-3.1-8B's shape with 4 windows: 4415 MiB, estimated 5858.
            layer += 4 * layer_params + 6 * 4 * widest
        if "awq" not in parts or "gptq" in parts:
            g = gptq or GptqConfig()
            layer += 3 * 4 * (inner * inner + 3 * h * h)  # Hessians, inverse, workspace
            layer += 3 * 4 * min(g.batch_sequences, samples) * seq_len * inner
        remedies["decoder layer"] = f"fewer calibration windows (--calib-samples, now {samples})"
    embed = entries[EMBED]
    stored = storage_dtype(source.config)
    outer = embed.nbytes * (1 if embed.dtype == stored else 2)
    remedies["embedding and head"] = "a machine with more memory"
    if quantize_head:
        outer = embed.nbytes + 3 * 4 * embed.shape[0] * embed.shape[1]
        remedies["embedding and head"] = "--dense-head"
    # Writing the checkpoint copies the staged files' bytes file to file: no phase of its own.
    phases = {"decoder layer": layer, "embedding and head": outer}
    if score:
        params = sum(math.prod(e.shape) for e in entries.values())
        phases["perplexity"] = 2 * 4 * params
        remedies["perplexity"] = "--eval-tokens 0 (no perplexity before and after)"
    return MemoryPlan(phases, remedies)


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
