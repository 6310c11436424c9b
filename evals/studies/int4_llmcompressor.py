"""Benchmark: llm-compressor's INT4 (W4A16) against quantkit's on the same calibration windows
and the same held-out tokens.

    python -m quantkit.evals.studies.int4_llmcompressor --peer-python PEER/bin/python
        [--recipes gptq awq+gptq] [--ckpt CKPT ...] [--peer-ckpt RECIPE=DIR ...]
        [--samples 128] [--seed 0] [--group-size 64] [--eval-tokens 16384] [--baseline F]
        [--work DIR] [--json F]

llm-compressor is a peer, never a dependency: it runs in its own environment (made once with
`python -m venv PEER && PEER/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0`), given by
--peer-python. quantkit draws the calibration windows (`calibration_samples`, as `quantize` and
the INT4 study do: 128 x 512 tokens of the calibration split, --seed), and the peer's `oneshot`
quantizes the embedded model's dense weights with them: asymmetric INT4, one group of
--group-size a scale, every Linear but the lm_head, by GPTQModifier (`gptq`) or AWQModifier
then GPTQModifier (`awq+gptq`). Each result, and every --ckpt (a quantkit checkpoint), is
scored by quantkit's perplexity on the INT4 study's held-out tokens (window 512), beside the
reference and round-to-nearest (or those of --baseline, an `int4_recipes` JSON measured on the
same tokens), as the share of the RTN gap closed. quantkit reads llm-compressor's checkpoints
as transformers + compressed-tensors do (logits equal to 1e-4 on SmolLM2-135M). A benchmark,
not a test: tens of minutes on 2 cores for `gptq`, over an hour for `awq+gptq` (its grid
search), which the peer's own progress shows as it goes.

--peer-ckpt RECIPE=DIR scores a checkpoint the peer wrote earlier with this study's script and
windows (`--work DIR` keeps them: DIR/awq_gptq for awq+gptq), say on a machine with a GPU,
instead of running that recipe again; `--recipes` then names only the recipes still to run
(none: `--recipes` alone).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from quantkit.evals.common import run_main

RECIPES = ("gptq", "awq+gptq")

# Run by the peer's Python: argv = windows.npy, model dir, recipe, group size, output dir.
_PEER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np, torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    windows, model_dir, recipe, group, out = sys.argv[1:6]
    if not torch.cuda.is_available():  # its AWQ pins a cache (CUDA only): a no-op on a CPU
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    ids = np.load(windows)
    mask = np.ones_like(ids).tolist()
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask})
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    scheme = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
              "symmetric": False, "strategy": "group", "group_size": int(group)}}}
    steps = []
    if recipe == "awq+gptq":
        from llmcompressor.modifiers.awq import AWQModifier
        steps.append(AWQModifier(ignore=["lm_head"], config_groups=scheme))
    steps.append(GPTQModifier(ignore=["lm_head"], config_groups=scheme))
    began = time.time()
    oneshot(model=model, dataset=data, recipe=steps, max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0])
    print("peer quantize s", round(time.time() - began), flush=True)
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    """
)


def _peer(python: str, windows: Path, model_dir: Path, recipe: str, group: int, out: Path) -> float:
    """Quantize with the peer in its own process, its output (progress) shown as it goes; its
    wall time in seconds."""
    began = time.perf_counter()
    proc = subprocess.run(
        [python, "-c", _PEER_SCRIPT, str(windows), str(model_dir), recipe, str(group), str(out)]
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"int4_llmcompressor: the peer's {recipe} failed with exit code {proc.returncode} "
            f"(its error above)"
        )
    return time.perf_counter() - began


def _peer_ckpts(given: list[str]) -> dict[str, Path]:
    """--peer-ckpt RECIPE=DIR pairs, each a recipe of RECIPES and an existing directory."""
    found: dict[str, Path] = {}
    for item in given:
        recipe, sep, where = item.partition("=")
        path = Path(where)
        if not sep or recipe not in RECIPES:
            raise SystemExit(
                f"int4_llmcompressor: expected --peer-ckpt RECIPE=DIR with RECIPE one of "
                f"{', '.join(RECIPES)}, got {item!r}"
            )
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"int4_llmcompressor: expected a checkpoint directory (config.json) for "
                f"--peer-ckpt {recipe}, got {where}"
            )
        found[recipe] = path
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m quantkit.evals.studies.int4_llmcompressor",
        description="llm-compressor's INT4 against quantkit's, same windows, same tokens.",
    )
    p.add_argument("--peer-python", required=True, help="the Python of llm-compressor's venv")
    p.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=RECIPES)
    p.add_argument(
        "--peer-ckpt",
        nargs="*",
        default=[],
        metavar="RECIPE=DIR",
        help="score a checkpoint the peer wrote earlier for RECIPE",
    )
    p.add_argument("--ckpt", nargs="*", default=[], help="quantkit checkpoints to score beside")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--baseline", type=Path, help="an int4_recipes JSON (reference, rtn)")
    p.add_argument("--work", type=Path, help="where the peer's checkpoints go (default: temp)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    earlier = _peer_ckpts(args.peer_ckpt)

    import numpy as np
    import torch

    from quantkit.evals.common import print_and_save
    from quantkit.evals.studies.heldout import earlier_baseline, held_out, ppl, reference_ppl
    from quantkit.format.scheme import QuantScheme
    from quantkit.models.decoder import build_model
    from quantkit.quantize.calibration import calibration_samples, wiki_split
    from quantkit.quantize.pipeline import quantize_model
    from quantkit.runtime.loader import load_model

    data = held_out("smollm2-135m", args.eval_tokens)
    results: dict[str, Any] = {"eval_tokens": data.tokens.numel(), "window": 512,
                               "group_size": args.group_size, "seed": args.seed}  # fmt: skip
    want = {"eval_tokens": data.tokens.numel(), "window": 512, "group_size": args.group_size}
    old = earlier_baseline(args.baseline, want)
    if old is not None:
        results["reference"], results["rtn"] = old["reference"], old["rtn"]
    else:
        results["reference"] = reference_ppl(data)
        rtn = quantize_model(data.model_dir, scheme=QuantScheme("int4", args.group_size))
        results["rtn"] = ppl(build_model(rtn.config, rtn.dense_state()), data.tokens)
    gap = results["rtn"] - results["reference"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        windows = work / "windows.npy"
        ids = calibration_samples(
            wiki_split().calibration, data.tokenizer, n_samples=args.samples,
            seq_len=args.seq_len, seed=args.seed,
        )  # fmt: skip
        np.save(windows, ids.numpy())
        # (label, the recipe for the peer to run now or None, the checkpoint to score)
        scored = [(f"llm-compressor {r}", r, work / r.replace("+", "_"))
                  for r in args.recipes if r not in earlier]  # fmt: skip
        scored += [(f"llm-compressor {r} (made earlier)", None, d) for r, d in earlier.items()]
        scored += [(f"quantkit {c}", None, Path(c)) for c in args.ckpt]
        for label, recipe, path in scored:
            seconds = None
            if recipe is not None:
                seconds = _peer(args.peer_python, windows, data.model_dir, recipe,
                                args.group_size, path)  # fmt: skip
            model = load_model(path, dtype=torch.float32, tokenizer=False).model
            value = ppl(model, data.tokens)
            rows.append({"what": label, "ppl": value, "gap_closed": (results["rtn"] - value) / gap,
                         "quantize_s": seconds})  # fmt: skip
            print(f"{label}: ppl {value:.3f}, {rows[-1]['gap_closed']:.1%} of the RTN gap",
                  flush=True)  # fmt: skip
    results["rows"] = rows
    lines = [f"reference {results['reference']:.3f}, rtn {results['rtn']:.3f} "
             f"({results['eval_tokens']} held-out tokens, window 512)"]  # fmt: skip
    lines += [f"{r['what']:<44} {r['ppl']:8.3f} {r['gap_closed']:7.1%}" for r in rows]
    print_and_save(results, "\n".join(lines), args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
