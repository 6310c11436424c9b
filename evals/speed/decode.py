"""Decode tok/s of the embedded model, quantkit dense and INT4 beside transformers, with MBU.

    python -m quantkit.evals.speed.decode [--new-tokens 128] [--batch 1 8] [--repeats 3]

Every engine runs in this one process, on the same threads and the same prompt, round-robin
per repeat (so a noisy neighbour slows all of them, not one); each configuration is warmed up
once first. Decode tok/s counts the decode steps only (prefill excluded), summed over the batch:
quantkit from its per-step timings, transformers from a logits processor that timestamps each
step. llama.cpp (`llama-cpp-python` or a `llama-bench` binary on PATH) is added when installed,
on the GGUF the embedded model ships as; it is never required. `--profile` prints where the
INT4 decode step spends its time. Results never gate anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.evals.common import git_commit, run_main, write_json_atomic

PROMPT = (
    "The printing press changed how knowledge moved through Europe. Before it, books were "
    "copied by hand, and a single volume could take a scribe months to finish."
)


@dataclass
class Row:
    engine: str
    weights: str
    batch: int
    tok_s: list[float] = field(default_factory=list)  # decode tok/s of each repeat
    ttft_ms: list[float] = field(default_factory=list)
    bytes_per_step: float | None = None  # weights + KV read per decode step

    def quantile(self, q: float) -> float:
        values = sorted(self.tok_s)
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


# --------------------------------------------------------------------------- engines


def _quantkit_runner(model: Any, ids: list[int], *, batch: int, new_tokens: int, compile: bool):
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)

    def run() -> tuple[float, float]:
        # No EOS: every run decodes exactly new_tokens, whatever the model says.
        stats = generate(model, [ids] * batch, params, compile=compile).stats
        return stats.decode_tok_s, stats.ttft_s * 1e3

    return run


def _transformers_runner(model: Any, ids: list[int], *, batch: int, new_tokens: int):
    import transformers

    class Stamp(transformers.LogitsProcessor):
        """Called once per generated token, right after its forward: a per-step clock."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    prompt = torch.tensor([ids] * batch)

    def run() -> tuple[float, float]:
        stamp = Stamp()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([stamp]),
                pad_token_id=0,
            )
        steps = len(stamp.times) - 1
        return batch * steps / (stamp.times[-1] - stamp.times[0]), (stamp.times[0] - start) * 1e3

    return run


def _llama_cpp_rows(gguf: Path, *, threads: int, new_tokens: int, repeats: int) -> list[Row]:
    """llama.cpp on the embedded GGUF at batch 1, if llama-bench or llama-cpp-python exists."""
    rows: list[Row] = []
    if shutil.which("llama-bench"):
        row = Row("llama.cpp (llama-bench)", "Q4_1 GGUF", 1)
        cmd = ["llama-bench", "-m", str(gguf), "-t", str(threads), "-p", "0"]
        cmd += ["-n", str(new_tokens), "-r", str(repeats), "-o", "json"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            for entry in json.loads(result.stdout):
                row.tok_s.extend(entry.get("samples_ts") or [entry["avg_ts"]])
            rows.append(row)
    try:
        from llama_cpp import Llama
    except ImportError:
        return rows
    llm = Llama(model_path=str(gguf), n_threads=threads, n_ctx=512, verbose=False)
    row = Row("llama.cpp (llama-cpp-python)", "Q4_1 GGUF", 1)
    tokens = llm.tokenize(PROMPT.encode())
    for _ in range(repeats + 1):  # the first is the warm-up
        llm.reset()
        llm.eval(tokens)
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([llm.sample(temp=0.0)])
        row.tok_s.append(new_tokens / (time.perf_counter() - start))
    row.tok_s = row.tok_s[1:]
    rows.append(row)
    return rows


def _gguf_read_bytes(gguf: Path) -> float:
    """Bytes llama.cpp reads per token: every tensor but the embedding, which it reads in full
    only when it doubles as the output matrix (tied)."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(gguf)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return float(
        sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied)
    )


# --------------------------------------------------------------------------- profile


def profile_decode(model: Any, ids: list[int], *, steps: int = 32, top: int = 15) -> str:
    """Self CPU time per op over `steps` decode steps of `model` (after a warm-up run)."""
    from torch.profiler import ProfilerActivity, profile

    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=steps)
    generate(model, [ids], params)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, [ids], params)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


# --------------------------------------------------------------------------- report


def format_table(rows: list[Row], *, bandwidth: float) -> str:
    header = (
        f"{'engine':<30} {'weights':<36} {'batch':>5} {'tok/s p50':>9} {'[p20, p80]':>15} "
        f"{'TTFT ms':>8} {'MB/token':>9} {'ceiling':>8} {'MBU':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if not r.tok_s:
            continue
        p50 = statistics.median(r.tok_s)
        spread = f"[{r.quantile(0.2):.1f}, {r.quantile(0.8):.1f}]"
        ttft = f"{statistics.median(r.ttft_ms):.0f}" if r.ttft_ms else "-"
        mb = ceiling = mbu = "-"
        if r.bytes_per_step:
            per_token = r.bytes_per_step / r.batch
            mb = f"{per_token / 1e6:.1f}"
            ceil = bandwidth / per_token
            ceiling, mbu = f"{ceil:.0f}", f"{p50 / ceil:.0%}"
        lines.append(
            f"{r.engine:<30} {r.weights:<36} {r.batch:>5} {p50:>9.1f} {spread:>15} {ttft:>8} "
            f"{mb:>9} {ceiling:>8} {mbu:>6}"
        )
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.speed.decode")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile", action="store_true", help="also run the compiled step")
    parser.add_argument("--skip", nargs="*", default=[], choices=["dense", "int4", "transformers"])
    parser.add_argument("--profile", action="store_true", help="profile INT4 decode and exit")
    parser.add_argument("--json", type=Path, help="write the rows and metadata here")
    parser.add_argument(
        "--int4",
        type=Path,
        help="an INT4 checkpoint of the embedded model (default: the cached AWQ one, made on "
        "first use)",
    )
    return parser.parse_args(argv)


# (kind, model or None when not loaded, weights label): what quantkit rows are run on.
_Engine = tuple[str, Any, str]
_Runner = Callable[[], tuple[float, float]]


def _engines(args: argparse.Namespace, int4: Any, dense: Any, scheme: str) -> list[_Engine]:
    """quantkit's engines: INT4 with the fp32 head, then (unless skipped) INT4 with the head
    and activations `auto` picks when they differ, then dense."""
    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.runtime.head import set_head_dtype
    from quantkit.runtime.loader import load_model

    engines = [("int4", int4, f"{scheme}, fp32 head"), ("dense", dense, "fp32 dense")]
    if "int4" not in args.skip:
        # The head is half of the INT4 model's traffic: show the CLI's default beside the fp32
        # head, not only the faster one (its head and GEMV activations as `auto` picks them).
        from quantkit.runtime.fast_path import auto_act_dtype, set_act_dtype
        from quantkit.runtime.head import auto_head_dtype

        narrow = load_model(args.int4 or ensure_embedded_int4(), tokenizer=False).model
        head, act = auto_head_dtype(narrow, quantized=True), auto_act_dtype(narrow, quantized=True)
        set_head_dtype(narrow, head)
        set_act_dtype(narrow, act)
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}
        if (head, act) != (torch.float32, torch.float32):
            label = f"{scheme}, {names[head]} head, {names[act]} act"
            engines.insert(1, ("int4", narrow, label))
    return engines


def _runners(
    args: argparse.Namespace, ids: list[int], engines: list[_Engine], *, hf: Any, dense: Any
) -> list[tuple[Row, _Runner]]:
    """One row and its runner per batch size and engine (eager, then compiled when asked),
    with transformers last in each batch size."""
    from quantkit.perf.roofline import model_kv_bytes_per_token, model_read_bytes

    modes = [False, True] if args.compile else [False]
    runners: list[tuple[Row, _Runner]] = []
    for batch in args.batch:
        context = len(ids) + args.new_tokens // 2  # mean cache length over the decode steps

        def step_bytes(model: Any, batch: int = batch, context: int = context) -> float:
            kv = batch * context * model_kv_bytes_per_token(model)
            return model_read_bytes(model).read_per_step + kv

        for kind, model, label in engines:
            if kind in args.skip or model is None:
                continue
            for compiled in modes:
                name = "quantkit" + (" (compiled)" if compiled else "")
                row = Row(name, label, batch, bytes_per_step=step_bytes(model))
                run = _quantkit_runner(
                    model, ids, batch=batch, new_tokens=args.new_tokens, compile=compiled
                )
                runners.append((row, run))
        if hf is not None and dense is not None:
            row = Row(
                "transformers generate", "fp32 dense", batch, bytes_per_step=step_bytes(dense)
            )
            runners.append(
                (row, _transformers_runner(hf, ids, batch=batch, new_tokens=args.new_tokens))
            )
    return runners


def _measure(runners: list[tuple[Row, _Runner]], *, repeats: int) -> list[Row]:
    """Warm every runner up once, then run them round-robin `repeats` times."""
    for _, run in runners:
        run()  # warm-up: kernel builds, compilation, first-touch page faults
    for _ in range(repeats):
        for row, run in runners:
            tok_s, ttft = run()
            row.tok_s.append(tok_s)
            row.ttft_ms.append(ttft)
    return [row for row, _ in runners]


def _report(args: argparse.Namespace, rows: list[Row], ids: list[int]) -> None:
    """Print the setup, the versions and the table; write the JSON when asked."""
    import transformers

    from quantkit.cpu import cpu_name
    from quantkit.perf.hardware import local_hardware
    from quantkit.sources.resolve import DEFAULT_MODEL

    hardware = local_hardware("cpu")
    print(
        f"decode benchmark: {DEFAULT_MODEL}, {len(ids)} prompt tokens + {args.new_tokens} new, "
        f"{args.threads} threads, {args.repeats} repeats"
    )
    print(f"device: CPU {cpu_name()}, peak {hardware.bandwidth / 1e9:.1f} GB/s ({hardware.source})")
    print(
        f"versions: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}, commit {git_commit()}"
    )
    print(format_table(rows, bandwidth=hardware.bandwidth))
    if args.json:
        meta = {
            "device": cpu_name(),
            "threads": args.threads,
            "bandwidth": hardware.bandwidth,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "commit": git_commit(),
            "new_tokens": args.new_tokens,
            "prompt_tokens": len(ids),
        }
        write_json_atomic(args.json, {"meta": meta, "rows": [asdict(r) for r in rows]}, indent=None)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.runtime.loader import load_model
    from quantkit.sources.resolve import DEFAULT_MODEL, embedded_gguf_path, resolve_model

    dense_dir = resolve_model(DEFAULT_MODEL)
    int4 = load_model(args.int4 or ensure_embedded_int4())
    scheme = int4.describe()
    ids = int4.tokenizer.encode(PROMPT)
    if args.profile:
        print(profile_decode(int4.model, ids))
        return

    dense = None
    if "dense" not in args.skip or "transformers" not in args.skip:
        dense = load_model(dense_dir, tokenizer=False).model  # also sizes the transformers row
    hf = None
    if "transformers" not in args.skip:
        hf = transformers.AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        hf.eval()
    engines = _engines(args, int4.model, dense, scheme)
    rows = _measure(_runners(args, ids, engines, hf=hf, dense=dense), repeats=args.repeats)
    gguf = embedded_gguf_path()
    for row in _llama_cpp_rows(
        gguf, threads=args.threads, new_tokens=args.new_tokens, repeats=args.repeats
    ):
        row.bytes_per_step = _gguf_read_bytes(gguf)
        rows.append(row)
    _report(args, rows, ids)


if __name__ == "__main__":
    run_main(main)
