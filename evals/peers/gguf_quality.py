"""Benchmark: quantkit's INT4 codes exported to GGUF against llama.cpp's own quantization of the
same source weights, by llama.cpp's own `llama-perplexity` on held-out text.

    python -m quantkit.evals.peers.gguf_quality CKPT [CKPT ...] [--source smollm2-135m]
        [--llama-types q4_0 q4_1] [--tokens 16384] [--ctx 512] [--threads 2] [--json F]

For the source model (a dense HF directory or the embedded default) it writes a bf16 GGUF
(`quantkit export gguf --type bf16`) and has `llama-quantize` make each `--llama-types` file
from it, with the token embeddings left bf16 as quantkit's exports leave them, so only the
Linears differ. Each CKPT is exported as it is (`quantkit export gguf`). Every file is scored by
`llama-perplexity` on the held-out Wikipedia split (articles never used for calibration), and
every quantkit file once more by quantkit itself with llama-perplexity's method (disjoint
`--ctx` windows, the second half of each scored), so "the export is lossless" is a comparison
of two numbers. llama.cpp comes from `python -m quantkit.evals.peers.llamacpp build`. A
benchmark, not a test: minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.evals.common import print_and_save, run_main
from quantkit.evals.peers.build import Children, PeerError, find_build
from quantkit.export.gguf import export_gguf
from quantkit.quantize.calibration import wiki_split
from quantkit.runtime.loader import load_model
from quantkit.sources.resolve import resolve_model
from quantkit.sources.tokenizer import load_tokenizer

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


@dataclass
class Row:
    label: str
    made_by: str  # what chose the codes
    file_mib: float
    llama_ppl: float
    llama_err: float
    quantkit_ppl: float | None  # quantkit's own run of the same weights, the same method


def heldout_text(tokenizer, tokens: int) -> tuple[str, torch.Tensor]:
    """Held-out articles joined by blank lines until they tokenize to >= `tokens`; the text and
    its token ids (no BOS: the tokenizers here add none)."""
    parts: list[str] = []
    for article in wiki_split().heldout:
        parts.append(article)
        ids = tokenizer("\n\n".join(parts), add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            break
    text = "\n\n".join(parts)
    return text, torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def llamacpp_method_ppl(logits_fn, tokens: torch.Tensor, ctx: int, chunks: int) -> float:
    """llama-perplexity's number: disjoint windows of `ctx` tokens; in each, the tokens after
    the first half are scored (positions ctx/2 .. ctx-2 predict the next)."""
    first = ctx // 2
    nll, count = 0.0, 0
    with torch.inference_mode():
        for c in range(chunks):
            ids = tokens[c * ctx : (c + 1) * ctx].unsqueeze(0)
            logp = F.log_softmax(logits_fn(ids).float()[0], dim=-1)
            target = ids[0, first + 1 :]
            nll -= float(logp[first:-1].gather(-1, target.unsqueeze(-1)).sum())
            count += target.numel()
    return math.exp(nll / count)


def _llama_ppl(children: Children, build, gguf: Path, text: Path, args) -> tuple[float, float]:
    cmd = [
        build.tool("llama-perplexity"),
        "-m",
        gguf,
        "-f",
        text,
        "-c",
        str(args.ctx),
        "-b",
        str(args.ctx),
        "--chunks",
        str(args.chunks),
        "-t",
        str(args.threads),
    ]
    done = children.run(cmd, stderr=subprocess.STDOUT)
    found = _FINAL.search(done.stdout or "")
    if done.returncode != 0 or found is None:
        tail = "\n".join((done.stdout or "").splitlines()[-15:])
        raise PeerError(
            f"llama-perplexity {gguf.name}: expected a final estimate, got exit "
            f"{done.returncode}:\n{tail}"
        )
    return float(found.group(1)), float(found.group(2))


def _algorithm(ckpt: Path) -> str:
    meta = ckpt / "quantkit.json"
    return json.loads(meta.read_text()).get("algorithm", "?") if meta.is_file() else "?"


def _say(row: Row) -> None:
    mine = "-" if row.quantkit_ppl is None else f"{row.quantkit_ppl:.4f}"
    print(
        f"{row.label}: llama.cpp PPL {row.llama_ppl:.4f} +/- {row.llama_err:.3f}, quantkit {mine}",
        flush=True,
    )


def _mib(path: Path) -> float:
    return path.stat().st_size / 2**20


def run(args: argparse.Namespace) -> dict:
    build = find_build()
    source = resolve_model(args.source)
    tokenizer = load_tokenizer(source)
    work = Path(args.work or tempfile.mkdtemp(prefix="gguf-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    text, tokens = heldout_text(tokenizer, args.tokens)
    args.chunks = tokens.numel() // args.ctx
    (work / "heldout.txt").write_text(text)
    rows: list[Row] = []
    with Children() as children:
        src = work / "source-bf16.gguf"
        export_gguf(source, src, int4_type="bf16", progress=False)
        ref = load_model(source)
        ppl, err = _llama_ppl(children, build, src, work / "heldout.txt", args)
        mine = llamacpp_method_ppl(ref.model, tokens, args.ctx, args.chunks)
        rows.append(Row("reference (bf16)", "-", _mib(src), ppl, err, mine))
        _say(rows[-1])
        del ref
        for qtype in args.llama_types:
            out = work / f"llama-{qtype}.gguf"
            cmd = [
                build.tool("llama-quantize"),
                "--token-embedding-type",
                "bf16",
                src,
                out,
                qtype.upper(),
                str(args.threads),
            ]
            done = children.run(cmd, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise PeerError(f"llama-quantize {qtype}: exit {done.returncode}")
            ppl, err = _llama_ppl(children, build, out, work / "heldout.txt", args)
            rows.append(Row(f"llama.cpp {qtype}", "llama-quantize", _mib(out), ppl, err, None))
            _say(rows[-1])
        for ckpt in args.checkpoints:
            ckpt = Path(ckpt)
            out = work / f"{ckpt.name}.gguf"
            report = export_gguf(ckpt, out, progress=False)
            loaded = load_model(ckpt)
            mine = llamacpp_method_ppl(loaded.model, tokens, args.ctx, args.chunks)
            del loaded
            ppl, err = _llama_ppl(children, build, out, work / "heldout.txt", args)
            label = f"quantkit {ckpt.name} -> {report.int4_type}"
            rows.append(Row(label, _algorithm(ckpt), _mib(out), ppl, err, mine))
            _say(rows[-1])
    return {
        "source": str(args.source),
        "llama_cpp": build.version,
        "tokens_scored": args.chunks * (args.ctx - 1 - args.ctx // 2),
        "ctx": args.ctx,
        "chunks": args.chunks,
        "rows": [asdict(r) for r in rows],
    }


def table(result: dict) -> str:
    lines = [
        f"held-out Wikipedia, {result['chunks']} x {result['ctx']}-token windows, "
        f"{result['tokens_scored']} tokens scored (llama-perplexity's method); "
        f"llama.cpp from llama-cpp-python {result['llama_cpp']}",
        f"{'file':<44} {'MiB':>7} {'llama.cpp PPL':>18} {'quantkit PPL':>13}",
    ]
    for r in result["rows"]:
        mine = "-" if r["quantkit_ppl"] is None else f"{r['quantkit_ppl']:.4f}"
        lines.append(
            f"{r['label']:<44} {r['file_mib']:>7.1f} "
            f"{r['llama_ppl']:>9.4f} +/- {r['llama_err']:.3f} {mine:>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="quantkit INT4 checkpoints to export and score")
    p.add_argument("--source", default="smollm2-135m", help="the dense model they came from")
    p.add_argument("--llama-types", nargs="*", default=["q4_0"], help="llama-quantize types")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens (>= 2 windows)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the GGUF files (default: a temp one)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tokens < 2 * args.ctx:
        p.error(f"--tokens: expected at least 2 x --ctx = {2 * args.ctx}, got {args.tokens}")
    result = run(args)
    print_and_save(result, table(result), args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
