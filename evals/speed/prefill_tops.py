"""Prefill in int8 TOPS against this CPU's vpdpbusd peak, for any checkpoint.

    python -m quantkit.evals.speed.prefill_tops --model CKPT [--tokens 512] [--repeats 3]
        [--threads N] [--json F]

Prefills --tokens random token ids (`generate`, one new token: the time is the TTFT) on the
checkpoint loaded as the CLI loads it, with the C step's phase timers on, and reports per run:
prompt tok/s, the layers' matmul phases (qkv, o, gate_up, down) in int8 GOPS (a product and its
add count 2; the multiply-adds a token needs are counted from config.json, the active experts'
only in a mixture of experts; the last layer's o and MLP for the last row alone where the C
step computes only that row's, `prefill_macs`), the whole prefill's GOPS, and each as a share of
the peak that `quantkit.evals.kernels.vnni_peak` measures in the same process at the same thread
count. The first prefill (kernel builds, weight layouts) is not counted. On a model the C step
does not run, or without AVX512-VNNI, it says so and reports tok/s only. Results never gate
anything.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from quantkit.evals.common import git_commit, print_and_save, run_main

MATMUL_PHASES = ("qkv", "o", "gate_up", "down")


def _layer_macs(config: Any) -> tuple[int, int, int]:
    """One token's multiply-adds in one layer: (q, k and v; o; the MLP, for a mixture of experts
    its top_k experts and the router)."""
    h, d = config.hidden_size, config.head_dim
    qkv = h * d * (config.num_heads + 2 * config.num_kv_heads)
    o = h * d * config.num_heads
    moe = config.moe
    mlp = 3 * h * config.intermediate_size
    if moe is not None:
        mlp = 3 * h * moe.intermediate * moe.top_k + h * moe.experts
    return qkv, o, mlp


def macs_per_token(config: Any) -> int:
    """The decoder layers' matmul multiply-adds for one token (q, k, v, o and the MLP; for a
    mixture of experts its top_k experts and the router), without attention and the head."""
    return config.num_layers * sum(_layer_macs(config))


def prefill_macs(config: Any, tokens: int, *, last_row_only: bool) -> int:
    """The layers' matmul multiply-adds of a `tokens`-token prefill. last_row_only: the C step
    computes the last layer's o and MLP for the last row alone (`CpuDecodePath.tail_rows`), its
    q, k and v for every row."""
    if not last_row_only:
        return macs_per_token(config) * tokens
    _, o, mlp = _layer_macs(config)
    return macs_per_token(config) * tokens - (o + mlp) * (tokens - 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from quantkit.cpu import cpu_name
    from quantkit.evals.kernels.vnni_peak import peak_gops
    from quantkit.fused_kernels.cpu.decode import decode_phases
    from quantkit.runtime.generate import generate
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions
    from quantkit.runtime.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    model = load_model(args.model, options=RuntimeOptions.cli(), tokenizer=False).model
    config = model.config
    ids = torch.randint(
        0, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    path = model.decode_path
    why_not = "no C step" if path is None else path.unsupported(model)
    generate(model, [ids], SamplingParams(max_new_tokens=1))  # warm up
    last_row_only = why_not is None and bool(getattr(path, "tail_rows", False))
    macs = prefill_macs(config, args.tokens, last_row_only=last_row_only)
    runs = []
    for _ in range(args.repeats):
        decode_phases(True)
        t0 = time.perf_counter()
        stats = generate(model, [ids], SamplingParams(max_new_tokens=1)).stats
        secs = stats.ttft_s if stats.ttft_s > 0 else time.perf_counter() - t0
        phases, _ = decode_phases(False)
        matmul_s = sum(phases[p] for p in MATMUL_PHASES)
        runs.append(
            {
                "seconds": secs,
                "tok_s": args.tokens / secs,
                "gops": 2 * macs / secs / 1e9,
                "matmul_s": matmul_s,
                "matmul_gops": 2 * macs / matmul_s / 1e9 if matmul_s > 0 else None,
                "phases_s": phases,
            }
        )
    peak = peak_gops(args.threads)
    return {
        "commit": git_commit(),
        "cpu": cpu_name(),
        "model": str(args.model),
        "threads": args.threads,
        "tokens": args.tokens,
        "c_step": why_not is None,
        "why_not_c_step": why_not,
        "macs_per_token": macs_per_token(config),
        "macs": macs,  # what the prefill did: the last layer's last row alone where it may
        "last_row_only": last_row_only,
        "peak_gops": peak or None,
        "runs": runs,
    }


def table(r: dict[str, Any]) -> str:
    peak = r["peak_gops"]

    def share(gops: float | None) -> str:
        if gops is None:
            return "-"
        return f"{gops:.0f}" + (f" ({gops / peak:.0%})" if peak else "")

    lines = [
        f"prefill of {r['tokens']} tokens, {r['model']}, {r['cpu']}, {r['threads']} threads; "
        + (f"vpdpbusd peak {peak:.0f} int8 GOPS" if peak else "no AVX512-VNNI: no int8 peak"),
        f"{'run':<5}{'tok/s':>8}{'whole GOPS':>16}{'matmul GOPS':>18}  slowest phases (ms)",
    ]
    if not r["c_step"]:
        lines[0] += f"; not on the C step ({r['why_not_c_step']}): no phase times"
    if r["last_row_only"]:  # the GOPS count the work the step does, not the whole prompt's
        lines[0] += "; the last layer's o and MLP for the last token only"
    for i, run_ in enumerate(r["runs"], 1):
        top = sorted(run_["phases_s"].items(), key=lambda kv: -kv[1])[:4]
        phases = " ".join(f"{k}={v * 1e3:.0f}" for k, v in top if v > 0)
        lines.append(
            f"{i:<5}{run_['tok_s']:>8.1f}{share(run_['gops']):>16}"
            f"{share(run_['matmul_gops']):>18}  {phases}"
        )
    med = statistics.median(run_["tok_s"] for run_ in r["runs"])
    lines.append(f"median {med:.1f} tok/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a quantized checkpoint")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1 or args.threads < 1:
        p.error(
            "--tokens, --repeats and --threads: expected >= 1, got "
            f"{args.tokens}, {args.repeats}, {args.threads}"
        )
    r = run(args)
    print_and_save(r, table(r), args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
