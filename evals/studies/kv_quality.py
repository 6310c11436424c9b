"""Benchmark: what a quantized KV cache (`--kv-dtype`) costs in accuracy at long context.

    python -m quantkit.evals.studies.kv_quality [--ckpt DIR] [--window 4096] [--eval-tokens 32768]
        [--prompts 3 --prompt-tokens 2048 --new-tokens 512] [--kv-dtypes float32 bfloat16 int8 fp8]

Loads an INT4/FP8 checkpoint (default: the embedded SmolLM2-135M AWQ INT4 one) as the commands
do (`RuntimeOptions.cli`), once per cache format, and measures two things:

- Held-out Wikipedia perplexity over `--eval-tokens` tokens in disjoint windows of `--window`,
  each window fed through the KV cache as one prefill: every token's attention reads the K/V of
  itself and the tokens before it back from the cache, in the cache's format, as a decode step
  reads them. (A window longer than the C step's rows runs the PyTorch layers, which read the
  same bytes; `tests/test_kv_cache.py` holds the two paths to each other.)
- Greedy agreement with the float32 cache: `--prompts` prompts of `--prompt-tokens` held-out
  tokens each (taken after the perplexity tokens), `--new-tokens` greedy tokens with each
  format; the share of positions equal to float32's up to the first difference (the prefix
  that matches), and over all positions.

It also prints the cache's bytes per token. Results never gate anything.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from quantkit.evals.common import print_and_save, run_main
from quantkit.perf.roofline import model_kv_bytes_per_token
from quantkit.quantize.calibration import heldout_tokens
from quantkit.quantize.embedded import ensure_embedded_int4
from quantkit.runtime.generate import generate
from quantkit.runtime.loader import load_model
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.sampling import SamplingParams
from quantkit.sources.tokenizer import load_tokenizer


def _window_nll(model, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of ids[1:] given the tokens before each, one prefill through the cache."""
    n = ids.numel()
    model.setup_cache(batch=1, max_len=n)
    pos = torch.arange(n).unsqueeze(0)
    mask = (torch.arange(n) <= pos[0, :, None]).view(1, 1, n, n)
    with torch.no_grad():
        logits = model(ids.unsqueeze(0), positions=pos, mask=mask)[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -float(logp.gather(-1, ids[1:].unsqueeze(-1)).sum())
    model.drop_cache()
    return nll, n - 1


def run(args: argparse.Namespace) -> dict:
    ckpt = Path(args.ckpt) if args.ckpt else ensure_embedded_int4()
    torch.set_num_threads(args.threads)
    need = args.eval_tokens + args.prompts * args.prompt_tokens
    held = heldout_tokens(load_tokenizer(ckpt), max_tokens=need)
    if held.numel() < need:
        raise SystemExit(f"held-out text: expected {need} tokens, got {held.numel()}")
    scored, rest = held[: args.eval_tokens], held[args.eval_tokens :]
    prompts = [
        rest[i * args.prompt_tokens : (i + 1) * args.prompt_tokens].tolist()
        for i in range(args.prompts)
    ]
    rows, reference = [], None
    for kind in args.kv_dtypes:
        model = load_model(ckpt, options=RuntimeOptions.cli(kv_dtype=kind)).model
        nll, count = 0.0, 0
        for begin in range(0, scored.numel() - 1, args.window):
            part = scored[begin : begin + args.window]
            if part.numel() < 2:
                break
            window_nll, n = _window_nll(model, part)
            nll, count = nll + window_nll, count + n
        outs = [
            generate(model, [p], SamplingParams(max_new_tokens=args.new_tokens)).tokens[0]
            for p in prompts
        ]
        if reference is None:
            reference = outs
        same = sum(a == b for ref, out in zip(reference, outs, strict=True)
                   for a, b in zip(ref, out, strict=False))  # fmt: skip
        prefix = 0
        for ref, out in zip(reference, outs, strict=True):
            k = 0
            while k < min(len(ref), len(out)) and ref[k] == out[k]:
                k += 1
            prefix += k
        total = sum(len(r) for r in reference)
        row = {
            "kv_dtype": kind,
            "kv_bytes_per_token": model_kv_bytes_per_token(model),
            "ppl": math.exp(nll / count),
            "scored_tokens": count,
            "agree_prefix": prefix / total,
            "agree_positions": same / total,
            "generated": [len(o) for o in outs],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {
        "ckpt": str(ckpt),
        "window": args.window,
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def table(r: dict) -> str:
    base = r["rows"][0]
    lines = [
        f"KV cache formats on {r['ckpt']}: held-out ppl (window {r['window']}, "
        f"{base['scored_tokens']} tokens scored), greedy agreement with {base['kv_dtype']} over "
        f"{r['prompts']} prompts of {r['prompt_tokens']} tokens x {r['new_tokens']} new",
        f"{'kv dtype':<10} {'KB/token':>9} {'ppl':>8} {'vs ' + base['kv_dtype']:>12} "
        f"{'same prefix':>12} {'same tokens':>12}",
    ]
    for row in r["rows"]:
        change = row["ppl"] / base["ppl"] - 1
        lines.append(
            f"{row['kv_dtype']:<10} {row['kv_bytes_per_token'] / 1024:9.1f} {row['ppl']:8.3f} "
            f"{change:+12.3%} {row['agree_prefix']:12.1%} {row['agree_positions']:12.1%}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default=None, help="default: the embedded INT4 checkpoint")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument(
        "--kv-dtypes", nargs="+", default=["float32", "bfloat16", "int8", "fp8"],
        help="the first is the reference of the agreement columns",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
