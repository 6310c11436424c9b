"""Benchmark: what bf16 or int8 activations in the C step's INT4 GEMVs cost in perplexity and
save in time.

    python -m quantkit.evals.studies.act_precision [CKPT] [--tokens 16384] [--window 512] \
        [--threads 2]

Perplexity of the held-out Wikipedia split computed through the one-call CPU step itself: each
window is one causal prefill (its tokens as rows at one cache row), then the head on every row.
It runs once with fp32, once with bf16 and once with int8 activations in the GEMVs (each where
the CPU has the instructions: AVX512-BF16, AVX512-VNNI; `set_act_dtype`), beside
the PyTorch path (dequantized weights and MKL, fp32), which the tests hold the fp32 step to.
The head is fp32 in every row, so only the activations differ. CKPT defaults to the
embedded model as INT4. A benchmark, not a test: about a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.evals.common import print_and_save, run_main
from quantkit.models.decoder import CausalLM
from quantkit.quantize.calibration import heldout_tokens
from quantkit.runtime.fast_path import (
    bf16_activations_available,
    int8_activations_available,
    set_act_dtype,
)
from quantkit.runtime.head import set_head_dtype
from quantkit.runtime.loader import LoadedModel, load_model


def _load(ckpt: str | None) -> LoadedModel:
    if ckpt is None:
        from quantkit.quantize.embedded import ensure_embedded_int4

        ckpt = str(ensure_embedded_int4())
    return load_model(ckpt, dtype=torch.float32, device=torch.device("cpu"))


def step_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits [1, T, V] of one window through the C step: a causal prefill at cache row 0."""
    if ids.shape[0] != 1:
        raise ValueError(f"ids: expected one window [1, T], got {tuple(ids.shape)}")
    t = ids.shape[1]
    model.setup_cache(batch=1, max_len=t)
    path = model.decode_path
    if path is None or path.step is None or t > path.max_rows:
        reason = "no C decode path" if path is None else path.reason
        raise ValueError(f"the C step cannot take this window ({t} tokens): {reason}")
    hidden = path.run_rows(model, ids[0].tolist(), list(range(t)), [0] * t)
    return model.logits(hidden.view(1, t, -1))


def _torch_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    model.drop_cache()  # no cache bound: the PyTorch layers
    return model(ids)


def measure(ckpt: str | None, *, tokens: int, window: int) -> list[dict]:
    loaded = _load(ckpt)
    model = loaded.model
    set_head_dtype(model, torch.float32)
    text = heldout_tokens(loaded.tokenizer, max_tokens=tokens)
    rows = []
    modes = [("pytorch (fp32, MKL)", None, _torch_logits), ("C step, fp32", torch.float32, None)]
    if bf16_activations_available():
        modes.append(("C step, bf16 activations", torch.bfloat16, None))
    if int8_activations_available():
        modes.append(("C step, int8 activations (VNNI)", torch.int8, None))
    for name, act, fn in modes:
        if act is not None:
            set_act_dtype(model, act)
        began = time.perf_counter()
        with torch.inference_mode():
            result = perplexity(
                lambda ids, fn=fn: (fn or step_logits)(model, ids),
                text,
                window=window,
                batch_size=1,
            )
        rows.append(
            {
                "mode": name,
                "ppl": result.ppl,
                "tokens": result.tokens,
                "seconds": time.perf_counter() - began,
            }
        )
        print(f"  {name}: ppl {result.ppl:.4f} ({rows[-1]['seconds']:.1f} s)", flush=True)
    model.drop_cache()
    return rows


def format_rows(rows: list[dict]) -> str:
    base = next(r["ppl"] for r in rows if r["mode"] == "C step, fp32")
    lines = [f"{'mode':32} {'ppl':>9} {'vs fp32 step':>13} {'tokens':>7} {'s':>6}"]
    for r in rows:
        delta = (r["ppl"] / base - 1) * 100
        lines.append(
            f"{r['mode']:32} {r['ppl']:9.4f} {delta:+12.3f}% {r['tokens']:7d} {r['seconds']:6.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=16384, help="Held-out tokens to score.")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="Write the rows to this file.")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.ckpt, tokens=args.tokens, window=args.window)
    print_and_save(rows, format_rows(rows), args.json)


if __name__ == "__main__":
    run_main(main)
