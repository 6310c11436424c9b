"""Where a decode token's time goes, phase by phase, against the bytes each phase reads.

    python -m quantkit.evals.speed.decode_phases [--batch 1 8] [--new-tokens 128] [--repeats 3]
        [--depth N] [--kv-dtype int8] [--act-dtype int8] [--head-dtype int8]

Greedy generation on the embedded INT4 model (or --model), as `quantkit generate` runs it. Every
decode step's time is split into:

- the C step's phases (`fused_kernels.decode_cpu.decode_phases`, summed over the layers): the
  four GEMVs (qkv, o, gate_up, down), the activations' rearrangement before each (permute), the
  norms and residual adds, rope and the K/V write, attention and SiLU;
- the binding around the C call (embedding lookup, rotary tables, argument checks, ctypes);
- the lm_head (with the final norm);
- the rest of the loop: sampling, stop checks, detokenizing, Python.

Each GEMV phase is shown with the bytes it reads (packed weights, scales, zero points) and the
bandwidth that makes, and attention with the KV cache bytes it reads (in the cache's format, at
the middle of the decode); the total with MBU against the machine's probed bandwidth. A benchmark:
it prints numbers and gates nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.evals.common import run_main
from quantkit.fused_kernels.cpu.decode import PHASES, decode_phases
from quantkit.perf.roofline import expert_read_share

__all__ = ["Breakdown", "format_breakdown", "measure", "weight_bytes_by_phase"]

_PROJECTION_PHASE = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                     "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}  # fmt: skip


@dataclass
class Breakdown:
    """Seconds per decode step, by part, over `steps` steps of `batch` rows."""

    batch: int
    steps: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    step_call: float = 0.0  # the whole C-step call from Python (phases + binding)
    head: float = 0.0
    total: float = 0.0

    def per_step(self, seconds: float) -> float:
        return seconds / max(self.steps, 1)


def weight_bytes_by_phase(model: Any, batch: int = 1) -> dict[str, float]:
    """Bytes each GEMV phase reads per step of `batch` rows (every layer's quantized
    projections of it; of a mixture of experts' the share the rows' top-k read on average,
    as `perf.roofline.model_read_bytes` counts it: `expert_read_share`)."""
    out = dict.fromkeys(("qkv", "o", "gate_up", "down"), 0.0)
    moe = model.config.moe
    share = 1.0 if moe is None else expert_read_share(moe, batch)
    for name, module in model.model.layers.named_modules():
        phase = _PROJECTION_PHASE.get(name.rsplit(".", 1)[-1])
        if phase is not None and hasattr(module, "weight_bytes"):
            out[phase] += module.weight_bytes() * (share if ".experts." in name else 1.0)
    return out


def measure(
    model: Any, prompt: list[int], *, batch: int, new_tokens: int, tokenizer: Any = None
) -> Breakdown:
    """One greedy generation of `batch` copies of `prompt`, timed by part (decode steps only);
    with `tokenizer`, the text is streamed as `quantkit generate` does."""
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    path = model.decode_path
    if path is None:
        raise ValueError("decode_phases: expected a model on the C decode path, got none")
    result = Breakdown(batch)
    run_rows, logits = path.run_rows, model.logits
    decoding = [False]

    def timed_rows(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not decoding[0]:
            return run_rows(*args, **kwargs)
        decode_phases(True)
        started = time.perf_counter()
        out = run_rows(*args, **kwargs)
        result.step_call += time.perf_counter() - started
        phases, _ = decode_phases(False)
        for name, seconds in phases.items():
            result.phases[name] += seconds
        return out

    def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = logits(hidden)
        if decoding[0]:
            result.head += time.perf_counter() - started
        return out

    def first_token(event: Any) -> None:
        decoding[0] = True  # the prefill is over: every later step is a decode step

    path.run_rows, model.logits = timed_rows, timed_logits
    try:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        stats = generate(
            model, [prompt] * batch, params, tokenizer=tokenizer, on_token=first_token
        ).stats
    finally:
        del path.run_rows, model.logits  # the class's methods again
    result.steps = len(stats.decode_latencies_s)
    result.total = sum(stats.decode_latencies_s)
    return result


def format_breakdown(b: Breakdown, weight_bytes: dict[str, float], head_bytes: float,
                     bandwidth: float) -> str:  # fmt: skip
    """The table: ms per step and share of it by part, and GB/s where the part reads weights."""
    ms = {name: b.per_step(s) * 1e3 for name, s in b.phases.items()}
    binding = b.per_step(b.step_call) * 1e3 - sum(ms.values())
    head = b.per_step(b.head) * 1e3
    total = b.per_step(b.total) * 1e3
    rows: list[tuple[str, float, float | None]] = [
        (f"C {name}", t, weight_bytes.get(name)) for name, t in ms.items()
    ]
    rows += [("C-step binding (embed, rope tables, ctypes)", binding, None),
             ("lm_head (+ final norm)", head, head_bytes),
             ("sampling, stop checks, text, loop", total - b.per_step(b.step_call) * 1e3 - head,
              None)]  # fmt: skip
    lines = [f"batch {b.batch}: {b.steps} decode steps, {total:.2f} ms a step, "
             f"{b.batch * 1e3 / total:.1f} tok/s",
             f"  {'part':<46} {'ms/step':>8} {'share':>6} {'MB':>7} {'GB/s':>6}"]  # fmt: skip
    for name, t, read in rows:
        mb = f"{read / 1e6:7.1f}" if read else f"{'':>7}"
        gbs = f"{read / t / 1e6:6.1f}" if read and t > 0 else f"{'':>6}"
        lines.append(f"  {name:<46} {t:8.3f} {t / total:6.1%} {mb} {gbs}")
    read = sum(weight_bytes.values()) + head_bytes
    mbu = read / (total / 1e3) / bandwidth
    lines.append(f"  weights and KV read a step {read / 1e6:.1f} MB: "
                 f"{read / total / 1e6:.1f} GB/s over the whole step, MBU {mbu:.0%} of "
                 f"{bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.speed.decode_phases")
    parser.add_argument("--model", default=None, help="default: the embedded model as INT4")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--depth", type=int, default=None,
        help="a prompt of this many random tokens (default: the benchmark's chat prompt)",
    )  # fmt: skip
    parser.add_argument("--kv-dtype", default="auto", help="the KV cache format, as --kv-dtype")
    parser.add_argument(
        "--act-dtype", default="auto", help="the GEMVs' activations, as --act-dtype"
    )
    parser.add_argument("--head-dtype", default="auto", help="the lm_head's, as --head-dtype")
    args = parser.parse_args(argv)

    from quantkit.evals.speed.decode import PROMPT
    from quantkit.perf.hardware import local_hardware
    from quantkit.perf.roofline import model_kv_bytes_per_token, model_read_bytes
    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.runtime.generate import encode_prompt
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions

    # As `quantkit generate` loads it: the head and activation dtypes this CPU runs fastest.
    options = RuntimeOptions(
        head_dtype=args.head_dtype, act_dtype=args.act_dtype, kv_dtype=args.kv_dtype
    )
    loaded = load_model(args.model or ensure_embedded_int4(), options=options)
    model = loaded.model
    prompt = encode_prompt(loaded.tokenizer, PROMPT)
    if args.depth is not None:
        rng = random.Random(0)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(args.depth)]
    # the head and norms: what a one-row step reads beyond the GEMVs
    head_bytes = model_read_bytes(model).read_per_step - sum(weight_bytes_by_phase(model).values())
    bandwidth = local_hardware("cpu").bandwidth
    print(f"{loaded.describe()}, {len(prompt)} prompt tokens + {args.new_tokens} new, "
          f"{torch.get_num_threads()} threads; the best of {args.repeats} runs")  # fmt: skip
    kv_token = model_kv_bytes_per_token(model)
    for batch in args.batch:
        context = len(prompt) + args.new_tokens // 2  # the mean position attended over
        gemv_bytes = weight_bytes_by_phase(model, batch)
        gemv_bytes["attention"] = batch * context * kv_token
        measure(model, prompt, batch=batch, new_tokens=8, tokenizer=loaded.tokenizer)  # warm-up
        runs = [measure(model, prompt, batch=batch, new_tokens=args.new_tokens,
                        tokenizer=loaded.tokenizer)
                for _ in range(args.repeats)]  # fmt: skip
        best = min(runs, key=lambda b: b.per_step(b.total))
        spread = sorted(b.per_step(b.total) * 1e3 for b in runs)
        print(format_breakdown(best, gemv_bytes, head_bytes, bandwidth))
        print(f"  step ms over the runs: {', '.join(f'{s:.2f}' for s in spread)} "
              f"(median {statistics.median(spread):.2f})")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
