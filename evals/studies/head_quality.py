"""Benchmark: what quantizing the lm_head costs in perplexity, and what it saves in bytes.

    python -m quantkit.evals.studies.head_quality [--ckpt DIR] [--eval-tokens 32768] [--write DIR]

Starts from an INT4/FP8 checkpoint (default: the embedded SmolLM2-135M AWQ INT4 one) and scores
held-out Wikipedia perplexity (window 512) with its body as stored and these heads: fp32 (the
checkpoint's dense head), bf16 (what a CPU with bf16 dot instructions runs by default), int8
with a scale per row (what `--head-dtype int8` runs, rounded when the model loads), on a VNNI
CPU int6 with a scale per 32 weights (`--head-dtype int6`, run by its kernel), the
checkpoint's own format rounded to nearest (what `quantize --quantize-head` stores), and FP8
per channel. Prints the head's bytes per decode step beside each. `--write DIR` also writes the
checkpoint with the quantized head, the same tensors `quantize --quantize-head` would write
(the head's rounding does not depend on the body's algorithm), for timing it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.evals.common import print_and_save, run_main
from quantkit.format.checkpoint import (
    dequantize_checkpoint_tensors,
    load_checkpoint,
    save_checkpoint,
)
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.bf16_gemv import I8I8_MAX_M, i8i8_gemv
from quantkit.fused_kernels.cpu.i6_gemv import GROUP as I6_GROUP
from quantkit.fused_kernels.cpu.i6_gemv import i6_gemv_available
from quantkit.models.decoder import build_model
from quantkit.quantize.calibration import heldout_tokens
from quantkit.quantize.embedded import ensure_embedded_int4
from quantkit.runtime.head import CastHead, Int6Head
from quantkit.sources.tokenizer import load_tokenizer


def _head_tensors(weight: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> dict:
    fmt = scheme.format
    return fmt.store(fmt.round_to_nearest(weight.float(), scheme), scheme, dtype=dtype)


class _Int8Int8Head(nn.Module):
    """The int8 head as a VNNI CPU runs it in a decode step (`i8i8_gemv`: the activations
    quantized to int8 per block too, the products in integers), over any number of rows,
    `I8I8_MAX_M` at a time: perplexity scores every position, which `CastHead` would send to
    the BLAS with fp32 activations."""

    def __init__(self, head: CastHead) -> None:
        super().__init__()
        assert head._i8i8 is not None
        self.packed = head._i8i8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        out = torch.cat([i8i8_gemv(part, self.packed) for part in rows.split(I8I8_MAX_M)])
        return out.view(*x.shape[:-1], -1)


def run(args: argparse.Namespace) -> dict:
    ckpt = Path(args.ckpt) if args.ckpt else ensure_embedded_int4()
    loaded = load_checkpoint(ckpt)
    assert loaded.scheme is not None, f"{ckpt}: expected a quantized checkpoint"
    scheme = loaded.scheme
    dense = dequantize_checkpoint_tensors(loaded, dtype=torch.float32)
    dense = {k: v.float() if v.is_floating_point() else v for k, v in dense.items()}
    head = dense.get("lm_head.weight", dense["model.embed_tokens.weight"])
    storage = loaded.tensors["model.embed_tokens.weight"].dtype
    held = heldout_tokens(load_tokenizer(ckpt), max_tokens=args.eval_tokens)
    model = build_model(loaded.config, dense)

    int8 = CastHead(head, torch.int8)  # what `--head-dtype int8` runs
    assert int8.scale is not None
    heads = {
        "fp32 (dense)": (head, head.numel() * 4),
        "bf16 (dense)": (head.to(torch.bfloat16).float(), head.numel() * 2),
        "int8 per row (--head-dtype int8)": (
            int8.weight.float() * int8.scale[:, None],
            int8.weight_bytes(),
        ),
    }
    if int8._i8i8 is not None:  # what a decode step runs on a CPU with AVX512-VNNI
        heads["int8 per row, int8 activations (VNNI)"] = (_Int8Int8Head(int8), int8.weight_bytes())
    if i6_gemv_available() and head.shape[1] % I6_GROUP == 0:  # `--head-dtype int6`, as run
        int6 = Int6Head(head)
        heads["int6 g32 (--head-dtype int6, VNNI)"] = (int6, int6.weight_bytes())
    for label, s in ((f"{scheme.describe()} RTN", scheme), ("fp8 per-channel RTN", None)):
        s = s or QuantScheme("fp8")
        s = s.resolve([("lm_head", head.shape[1])])
        tensors = _head_tensors(head, s, storage)
        nbytes = sum(
            t.numel() * t.element_size() for k, t in tensors.items() if k != "weight_shape"
        )
        heads[label] = (s.format.dequantize(tensors, s, dtype=torch.float32), nbytes)
        if s == scheme:
            own = tensors

    results: dict = {"ckpt": str(ckpt), "scheme": scheme.describe(), "eval_tokens": held.numel()}
    rows = []
    for label, (w, nbytes) in heads.items():
        if isinstance(w, nn.Module):
            model.lm_head = w
        else:
            model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
            model.lm_head.weight = nn.Parameter(w, requires_grad=False)
        ppl = perplexity(model, held, window=512, progress=True).ppl
        rows.append({"head": label, "head_mb_per_step": nbytes / 1e6, "ppl": ppl})
        print(f"{label:<40} head {nbytes / 1e6:6.1f} MB/step  ppl {ppl:.3f}", flush=True)
    results["rows"] = rows

    if args.write:
        tensors = dict(loaded.tensors)
        tensors.pop("lm_head.weight", None)
        tensors.update({f"lm_head.{k}": v for k, v in own.items()})
        save_checkpoint(
            Path(args.write),
            source_dir=ckpt,
            config={k: v for k, v in loaded.config.items() if k != "quantization_config"},
            tensors=tensors,
            scheme=scheme,
            algorithm=loaded.algorithm or "rtn",
            quantized_modules=[*loaded.quantized_modules, "lm_head"],
            report={
                **(loaded.report or {}),
                "head": "rounded to nearest (evals/studies/head_quality)",
            },
            force=True,
        )
        print(f"wrote {args.write}")
    return results


def table(r: dict) -> str:
    base = r["rows"][0]["ppl"]
    lines = [
        f"lm_head on {r['scheme']}, held-out ppl over {r['eval_tokens']} tokens (window 512)",
        f"{'head':<40} {'MB/step':>8} {'ppl':>8} {'vs fp32':>8}",
    ]
    for row in r["rows"]:
        change = row["ppl"] / base - 1
        lines.append(
            f"{row['head']:<40} {row['head_mb_per_step']:8.1f} {row['ppl']:8.3f} {change:+8.2%}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default=None, help="default: the embedded INT4 checkpoint")
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--write", default=None, help="also write the quantized-head checkpoint")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = run(args)
    print_and_save(results, table(results), args.json)


if __name__ == "__main__":
    run_main(main)
