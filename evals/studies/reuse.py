"""Fewer forward passes, measured: prefix caching and prompt-lookup speculative decoding on the
embedded INT4 model, each with and without, in one process, alternating.

    python -m quantkit.evals.studies.reuse prefix     [--requests 16,48] [--rate 1] [--shared 512]
    python -m quantkit.evals.studies.reuse speculate  [--paragraphs 4] [--max-new-tokens 128]

prefix: requests that share a system prompt of --shared tokens (held-out Wikipedia text), each
followed by its own 16-48 tokens and answered with 32, served by the engine (cap 8, chunked
prefill 64) with the prefix cache off and on: TTFT p50 (all requests, and those after the first),
throughput, prompt tokens prefilled, and whether every request got the same greedy tokens.

speculate: input-grounded prompts (repeat, summarize, extract from a held-out paragraph) and
free-form prompts, greedy, at batch 1 (`generate`) and at batch cap 8 (the engine, every
request at t = 0), plain and with `--speculate ngram`: decode tok/s, acceptance, tokens per
model call, and whether the tokens are identical.

A benchmark, not a test: it prints numbers. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from quantkit.batching.engine import EngineConfig, run_engine
from quantkit.batching.workload import LengthDist, Request, WorkloadSpec, make_workload
from quantkit.evals.common import run_main
from quantkit.quantize.calibration import heldout_tokens, wiki_split
from quantkit.quantize.embedded import ensure_embedded_int4
from quantkit.runtime.generate import encode_prompt, eos_token_ids, generate
from quantkit.runtime.loader import LoadedModel, load_model
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.sampling import SamplingParams
from quantkit.runtime.speculate import SpecConfig

FREE_FORM = (
    "Write a short story about a robot who learns to paint.",
    "Give me three tips for sleeping better, with a reason for each.",
    "Describe a walk through a city at night.",
    "Invent a new board game and explain its rules.",
)
TASKS = {
    "repeat": "Repeat the following passage word for word.\n\n{p}",
    "summarize": "Summarize the following passage in two sentences.\n\n{p}",
    "extract": "List every year, person and place named in the following passage.\n\n{p}",
}


def _load() -> LoadedModel:
    torch.set_num_threads(torch.get_num_threads())
    return load_model(ensure_embedded_int4(), options=RuntimeOptions.cli())


def _paragraphs(n: int) -> list[str]:
    """n held-out paragraphs of 400-900 characters, from different articles where possible."""
    out: list[str] = []
    for article in wiki_split().heldout:
        paras = [p for p in article.split("\n\n") if 400 <= len(p) <= 900]
        if paras:
            out.append(paras[len(paras) // 2])
        if len(out) == n:
            break
    return out


# --------------------------------------------------------------------------- prefix


def _ttft_ms(run: Any, skip_first: bool) -> float:
    done = sorted((r for r in run.requests if r.token_times_s), key=lambda r: r.arrival_s)
    values = [r.ttft_s for r in done[1:] if skip_first] or [r.ttft_s for r in done]
    return 1e3 * statistics.median(values)


def bench_prefix(
    requests: list[int], rate: float, shared: int, cache_mb: float, *, invariant: bool
) -> None:
    loaded = _load()
    model, cfg = loaded.model, loaded.model.config
    stream = heldout_tokens(loaded.tokenizer, max_tokens=50_000).tolist()
    print(f"prefix caching: {shared}-token shared prompt, own 16-48 tokens, 32 out, cap 8, "
          f"chunk 64, rate {rate:g} req/s, batch invariant {invariant}")  # fmt: skip
    print(f"{'requests':>8} {'cache':>5} {'TTFT p50 ms':>11} {'after 1st':>9} "
          f"{'tok/s':>7} {'prefilled':>9} {'reused':>7} {'same':>5}")  # fmt: skip
    for n in requests:
        spec = WorkloadSpec(
            requests=n, rate=rate, prompt_len=LengthDist("uniform", 16, 48),
            output_len=LengthDist("fixed", 32), seed=1, shared_prefix_len=shared,
        )  # fmt: skip
        work = make_workload(
            spec, vocab_size=cfg.vocab_size, max_total=cfg.max_position_embeddings,
            source_tokens=stream,
        )  # fmt: skip
        warm = [Request(0, work[0].prompt[:64], 4, 0.0)]
        run_engine(model, warm, EngineConfig(batch_cap=2, chunk=64))
        tokens = None
        for mb in (0.0, cache_mb):
            engine = EngineConfig(
                batch_cap=8, chunk=64, prefix_cache_mb=mb, batch_invariant=invariant
            )
            run = run_engine(model, work, engine)
            out = [r.tokens for r in run.requests]
            same = "-" if tokens is None else str(out == tokens)
            tokens = tokens or out
            made = sum(len(r.tokens) for r in run.requests)
            prefilled = sum(c.tokens for c in run.prefill_chunks)
            reused = run.prefix_cache["hit_tokens"] if run.prefix_cache else 0
            print(
                f"{n:>8} {'on' if mb else 'off':>5} {_ttft_ms(run, False):>11.0f} "
                f"{_ttft_ms(run, True):>9.0f} {made / run.duration_s:>7.1f} {prefilled:>9} "
                f"{reused:>7} {same:>5}",
                flush=True,
            )


# --------------------------------------------------------------------------- speculation


def _prompts(loaded: LoadedModel, paragraphs: int) -> dict[str, list[list[int]]]:
    tok = loaded.tokenizer
    paras = _paragraphs(paragraphs)
    groups = {
        name: [encode_prompt(tok, template.format(p=p)) for p in paras]
        for name, template in TASKS.items()
    }
    groups["free-form"] = [encode_prompt(tok, text) for text in FREE_FORM]
    return groups


def bench_speculate(paragraphs: int, max_new_tokens: int, k: int, *, invariant: bool) -> None:
    loaded = _load()
    model = loaded.model
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    config = SpecConfig(k=k)
    groups = _prompts(loaded, paragraphs)
    generate(model, [groups["free-form"][0]], SamplingParams(max_new_tokens=8))  # warm-up
    print(f"speculative decoding (ngram:{k}), greedy, {max_new_tokens} new tokens at most")
    print(f"{'prompts':<10} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
          f"{'accepted':>9} {'tok/call':>8} {'same':>5}")  # fmt: skip
    alone: dict[str, list[list[int]]] = {}  # batch-1 plain tokens: the cap-8 reference
    for name, prompts in groups.items():
        alone[name] = []
        totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
        same, drafted, accepted, emitted, calls = True, 0, 0, 0, 0
        for i, ids in enumerate(prompts):
            runs = {}
            order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
            for kind in order:
                spec = config if kind == "spec" else None
                r = generate(model, [ids], params, eos_ids=eos, speculate=spec)
                runs[kind] = r
                totals[kind][0] += len(r.stats.decode_latencies_s)
                totals[kind][1] += r.stats.decode_s
            same &= runs["spec"].tokens == runs["plain"].tokens
            alone[name].append(runs["plain"].tokens[0])
            s = runs["spec"].stats.speculation
            drafted, accepted = drafted + s.drafted, accepted + s.accepted
            emitted, calls = emitted + s.emitted, calls + s.verify_steps + s.plain_steps
        plain = totals["plain"][0] / totals["plain"][1]
        fast = totals["spec"][0] / totals["spec"][1]
        rate = f"{accepted}/{drafted}"
        print(f"{name:<10} {1:>5} {plain:>11.1f} {fast:>10.1f} {fast / plain:>6.2f}x "
              f"{rate:>9} {emitted / max(calls, 1):>8.2f} {same!s:>5}", flush=True)  # fmt: skip
    for name, prompts in groups.items():
        requests = [Request(i, tuple(p), max_new_tokens, 0.0) for i, p in enumerate(prompts * 2)]
        results = {}
        for kind in ("plain", "spec"):
            spec_or_none = config if kind == "spec" else None
            engine = EngineConfig(
                batch_cap=8, chunk=64, speculate=spec_or_none, batch_invariant=invariant
            )
            began = time.perf_counter()
            run = run_engine(model, requests, engine, eos_ids=eos)
            results[kind] = (run, time.perf_counter() - began)
        rates = {}
        for kind, (run, _) in results.items():
            made = sum(len(r.tokens) for r in run.requests)
            rates[kind] = made / run.duration_s if run.duration_s > 0 else math.nan
        run = results["spec"][0]
        spec = run.speculation or {}
        ref = alone[name] * 2
        matches = {
            kind: f"{sum(r.tokens == t for r, t in zip(got.requests, ref, strict=True))}/{len(ref)}"
            for kind, (got, _) in results.items()
        }

        rate = f"{spec.get('accepted_tokens', 0)}/{spec.get('drafted_tokens', 0)}"
        print(f"{name:<10} {8:>5} {rates['plain']:>11.1f} {rates['spec']:>10.1f} "
              f"{rates['spec'] / rates['plain']:>6.2f}x {rate:>9} "
              f"{spec.get('tokens_per_step', 0):>8.2f}  plain {matches['plain']}, "
              f"spec {matches['spec']} as alone", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prefix", help="prefix caching: TTFT and throughput, off vs on")
    p.add_argument("--requests", default="16,48", help="comma-separated request counts")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson); inf = all")
    p.add_argument("--shared", type=int, default=512, help="shared system-prompt tokens")
    p.add_argument("--cache-mb", type=float, default=256.0)
    s = sub.add_parser("speculate", help="speculative decoding: tok/s, off vs on")
    s.add_argument("--paragraphs", type=int, default=4, help="held-out paragraphs per task")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--k", type=int, default=4, help="draft tokens at most")
    for sp in (p, s):
        sp.add_argument(
            "--batch-invariant",
            action="store_true",
            help="engine runs batch-invariant (each request exactly as alone)",
        )
    args = parser.parse_args(argv)
    if args.what == "prefix":
        counts = [int(x) for x in args.requests.split(",")]
        bench_prefix(counts, args.rate, args.shared, args.cache_mb, invariant=args.batch_invariant)
    else:
        bench_speculate(
            args.paragraphs, args.max_new_tokens, args.k, invariant=args.batch_invariant
        )


if __name__ == "__main__":
    run_main(main)
