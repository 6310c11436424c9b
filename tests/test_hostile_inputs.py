"""Hostile inputs and broken files through the real CLI: one line, the right exit class, no
traceback, nothing half-written.

Exit classes (`quantkit.cli.main`): 2 usage, 3 input data, 4 environment, 70 a bug (traceback in
a log file), 130 interrupted.

The cases run `quantkit` in a child process (`WarmCli`): forked from an interpreter that has
already imported what every command imports (2 s paid once per module, not once per case), each
child with its own environment, working folder, stdin, stdout and stderr, exit status and
signals, and with `$QUANTKIT_HOME` its own (seeded with the built CPU kernels and the measured
bandwidth). Where the interpreter's own start matters (Ctrl-C during the imports), and once as a
check that a forked child answers as the console script does, a fresh `python -m
quantkit.cli.main` runs instead. The few cases that need a fault injected into the library (a
write that fails midway, an unexpected exception) run in-process with monkeypatch.

Classes of subprocess cases, one section each: corrupt checkpoints, generate input (the
--max-new-tokens warning included), roofline, eval / lm-eval (the "wrong-result" ids: rows that
used to pass the check and be scored as something else), corrupt grammar caches (every damage
of every kind of entry: one warning line, rebuilt, the clean run's output), disk and file
system, interrupts, leftovers of killed writers, and grammar options that used to slip through.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_LLAMA, run_cli
from tests.sigint_hook import sigint_hook_source

USAGE, DATA, ENVIRONMENT, BUG, INTERRUPTED = 2, 3, 4, 70, 130
CONTEXT = TINY_LLAMA["max_position_embeddings"]

# --------------------------------------------------------------------- the CLI in a child process

_WARM_CLI = (
    sigint_hook_source()
    + r"""
import atexit, json, os, resource, signal, sys

signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is for the cases
import quantkit.cli.commands  # noqa: F401 - what every command imports, once for all cases
from quantkit.cli.main import main
from quantkit.evals.accuracy.harness import offline_env

offline_env()  # eval and lm-eval import lm-eval and datasets lazily: 2 s, paid here instead
import lm_eval._cli, lm_eval.evaluator
import quantkit.evals.accuracy.compare, quantkit.evals.accuracy.lm_eval_model
# transformers loads these lazily, on the first tokenizer or config, and torch its dynamo, on
# the first model built on the meta device: 2.5 + 2.5 s more, once.
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast
import torch._dynamo

WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def child(req):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], WRITE),
                            (2, req["err"], WRITE)):
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    if req["fsize"] is not None:  # ulimit -f: a write past it fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
    sys.argv = ["quantkit", *req["args"]]
    if req["sigint_at"] is not None:
        # SIGINT, as a Ctrl-C, as the call starts (a KeyboardInterrupt raised there).
        at_call(req["sigint_at"], lambda spec: os.kill(os.getpid(), signal.SIGINT))
    code = 0
    try:
        main(req["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            child(json.loads(line))
        finally:
            os._exit(99)
    print(f"pid {pid}", flush=True)
    print(f"exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
"""
)


@dataclass(frozen=True)
class Ran:
    """One `quantkit` run: exit code, stdout, stderr."""

    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        """stderr's messages: progress bars (redrawn with carriage returns), eval's "[1/2]
        reference: ..." and generate's "compiling ... ..." are progress, not messages."""
        return [ln for ln in self.err.splitlines() if ln.strip() and not _PROGRESS.search(ln)]


_PROGRESS = re.compile(r"%\||^\[\d+/\d+\] |^compiling .* \.\.\.$")


def _env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, QUANTKIT_HOME=str(home), OMP_NUM_THREADS="1")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home / "hf"))
    return {**env, **(extra or {})}


class WarmCli:
    """`quantkit` in child processes forked from one warm interpreter (see the module
    docstring); `run` waits for one and returns what it printed and its exit code."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.count, self.buffer = folder, itertools.count(), b""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WARM_CLI],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(folder),  # HF_HOME there, offline: nothing read or written elsewhere
        )
        if self._line(300) != "ready":
            self.close()
            raise RuntimeError("the warm quantkit process did not start")

    def _line(self, timeout_s: float) -> str | None:
        """The next line the warm process prints, or None past `timeout_s` (or if it died)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def run(
        self,
        *args: str | Path,
        home: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        fsize: int | None = None,
        stdout: bool = True,
        interrupt_at: str | None = None,
        timeout_s: float = 120.0,
    ) -> Ran:
        """`quantkit ARGS` with $QUANTKIT_HOME=`home`; fsize: ulimit -f in bytes; stdout False:
        to /dev/null; interrupt_at: SIGINT (Ctrl-C) as the Nth call of a function starts,
        "MODULE:QUALNAME[#N]" (a point in the run, not a time: the same under any load)."""
        n = next(self.count)
        out, err = self.folder / f"{n}.out", self.folder / f"{n}.err"
        request = {
            "args": [str(a) for a in args],
            "env": _env(home, env),
            "cwd": str(cwd or self.folder),
            "out": str(out) if stdout else os.devnull,
            "err": str(err),
            "fsize": fsize,
            "sigint_at": interrupt_at,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        started = self._line(60)
        assert started is not None and started.startswith("pid "), started
        pid = int(started.split()[1])
        status = self._line(timeout_s)
        if status is None:
            _signal(pid, signal.SIGKILL)
            self._line(60)
            pytest.fail(f"quantkit {' '.join(request['args'])}: still running after {timeout_s} s")
        text = out.read_text(errors="replace") if stdout else ""
        return Ran(int(status.split()[1]), text, err.read_text(errors="replace"))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it had finished already
        pass


def fresh_cli(*args: str | Path, home: Path, timeout_s: float = 120.0) -> Ran:
    """`python -m quantkit.cli.main ARGS` in a new interpreter, imports and all."""
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli.main", *(str(a) for a in args)],
        capture_output=True,
        text=True,
        env=_env(home),
        timeout=timeout_s,
    )
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def _check(ran: Ran, want: int, needle: str) -> None:
    """Exit code `want`, exactly one line on stderr holding `needle`, no traceback."""
    assert "Traceback" not in ran.err, ran.err
    assert ran.code == want and len(ran.lines) == 1, (ran.code, ran.err)
    assert needle in ran.lines[0], (needle, ran.lines[0])


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def _home_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def ckpt(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto"))
    out = tmp_path_factory.mktemp("hostile") / "tiny-int4"
    return outcome.save(out, source_dir=tiny_model_dir)


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmCli]:
    warm = WarmCli(tmp_path_factory.mktemp("warm-cli"))
    yield warm
    warm.close()


@pytest.fixture(scope="module")
def seed_home(cli: WarmCli, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home with the CPU kernels built and this machine's bandwidth measured (seconds, once),
    copied into every case's own."""
    home = tmp_path_factory.mktemp("seed") / "home"
    ran = cli.run("generate", ckpt, "--prompt", "hi", "--max-new-tokens", "2", home=home)
    assert ran.code == 0, ran.err
    # Marked quiet: a figure probed while the suite loads the machine is probed again at the
    # next use, and under a case's write limit that re-probe's cache write adds a warning line.
    cache = home / "bandwidth.json"
    entries = json.loads(cache.read_text())
    cache.write_text(json.dumps({k: {**v, "others_load": 0.0} for k, v in entries.items()}))
    return home


@pytest.fixture()
def home(seed_home: Path, tmp_path: Path) -> Path:
    """This case's $QUANTKIT_HOME (the same folder in-process cases get)."""
    return _seeded(seed_home, tmp_path / "home")


def _seeded(seed: Path, home: Path) -> Path:
    home.mkdir(parents=True)
    for name in ("kernels", "bandwidth.json"):
        if (seed / name).is_dir():
            shutil.copytree(seed / name, home / name)
        elif (seed / name).is_file():
            shutil.copy2(seed / name, home / name)
    return home


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, change: Callable[[dict], object]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    new = change(cfg)
    (path / "config.json").write_text(json.dumps(cfg if new is None else new))


def _edit_tensors(path: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _first(tensors: dict, suffix: str) -> str:
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def _narrow(t: torch.Tensor) -> torch.Tensor:
    return t[:, :1].contiguous()


def _nan_scale(t: dict) -> None:
    t[_first(t, "weight_scale")][0, 0] = float("nan")


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


# (id, how to damage a copy of the checkpoint, command after the checkpoint path, class, needle)
DAMAGED: list[tuple[str, Callable[[Path], None], list[str], int, str]] = [
    ("truncated-shard-inspect", _truncate, ["inspect"], DATA, "complete safetensors"),
    ("truncated-shard-generate", _truncate, ["generate"], DATA, "complete safetensors"),
    (
        "empty-shard",
        lambda p: (p / "model.safetensors").write_bytes(b""),
        ["inspect"],
        DATA,
        "safetensors",
    ),
    (
        "four-byte-shard",
        lambda p: (p / "model.safetensors").write_bytes(b"\x00\x01\x02\x03"),
        ["inspect"],
        DATA,
        "safetensors",
    ),
    (
        "garbage-shard",
        lambda p: (p / "model.safetensors").write_bytes(os.urandom(4096)),
        ["generate"],
        DATA,
        "safetensors",
    ),
    (
        "quant-config-list",
        lambda p: _edit_config(p, lambda c: c.update(quantization_config=[1, 2])),
        ["inspect"],
        DATA,
        "quantization_config: expected an object, got list",
    ),
    (
        "quant-config-string",
        lambda p: _edit_config(p, lambda c: c.update(quantization_config="int4")),
        ["inspect"],
        DATA,
        "quantization_config: expected an object, got str",
    ),
    (
        "quant-config-empty-group",
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"].update(config_groups={"group_0": {}})
        ),
        ["inspect"],
        DATA,
        "targets",
    ),
    (
        "quant-config-group-string",
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"].update(config_groups={"group_0": "x"})
        ),
        ["generate"],
        DATA,
        "group_0: expected an object, got str",
    ),
    (
        "config-not-json",
        lambda p: (p / "config.json").write_text("{not json"),
        ["inspect"],
        DATA,
        "config.json",
    ),
    (
        "config-a-list",
        lambda p: (p / "config.json").write_text("[1, 2]"),
        ["generate"],
        DATA,
        "config.json",
    ),
    (
        "config-fewer-layers",
        lambda p: _edit_config(p, lambda c: c.update(num_hidden_layers=1)),
        ["generate"],
        DATA,
        "has no place in",
    ),
    (
        "config-more-layers",
        lambda p: _edit_config(p, lambda c: c.update(num_hidden_layers=3)),
        ["generate"],
        DATA,
        "missing",
    ),
    (
        "config-other-hidden-size",
        lambda p: _edit_config(p, lambda c: c.update(hidden_size=128)),
        ["generate"],
        DATA,
        "the config does not describe these weights",
    ),
    (
        "config-missing-field",
        lambda p: _edit_config(p, lambda c: c.pop("num_attention_heads") and None),
        ["generate"],
        DATA,
        "num_attention_heads",
    ),
    (
        "tensor-wrong-dtype",
        lambda p: _edit_tensors(
            p,
            lambda t: t.update({_first(t, "weight_packed"): t[_first(t, "weight_packed")].long()}),
        ),
        ["inspect"],
        DATA,
        "expected dtype int32, got int64",
    ),
    (
        "tensor-wrong-shape",
        lambda p: _edit_tensors(
            p,
            lambda t: t.update(
                {_first(t, "weight_scale"): t[_first(t, "weight_scale")][:, :1].contiguous()}
            ),
        ),
        ["generate"],
        DATA,
        "expected shape",
    ),
    ("nan-scale", lambda p: _edit_tensors(p, _nan_scale), ["generate"], DATA, "finite"),
    (
        "garbage-tokenizer",
        lambda p: (p / "tokenizer.json").write_text("garbage{"),
        ["generate"],
        DATA,
        "tokenizer",
    ),
    (
        "metadata-not-json",
        lambda p: (p / "quantkit.json").write_text("]["),
        ["inspect"],
        DATA,
        "quantkit.json",
    ),
]


# ------------------------------------------------------------------------ corrupt checkpoints


@pytest.mark.parametrize(
    ("damage", "command", "want", "needle"),
    [case[1:] for case in DAMAGED],
    ids=[case[0] for case in DAMAGED],
)
def test_a_damaged_checkpoint_is_one_line(
    cli: WarmCli, ckpt: Path, home: Path, tmp_path: Path, damage, command, want, needle
) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    damage(bad)
    extra = ["--prompt", "hi", "--max-new-tokens", "2"] if command == ["generate"] else []
    _check(cli.run(*command, bad, *extra, home=home), want, needle)


def test_a_forked_child_answers_as_a_fresh_interpreter(
    cli: WarmCli, ckpt: Path, home: Path, tmp_path: Path
) -> None:
    """The same damaged checkpoint through a fresh `python -m quantkit.cli.main`: the same one
    line and exit code as the forked child gives (what every other case relies on)."""
    bad = _copy(ckpt, tmp_path / "bad")
    _truncate(bad)
    fresh, forked = fresh_cli("inspect", bad, home=home), cli.run("inspect", bad, home=home)
    _check(fresh, DATA, "complete safetensors")
    assert (fresh.code, fresh.lines) == (forked.code, forked.lines)


# ------------------------------------------------------------------------------ generate input

LONG_PROMPT = "Beautiful is better than ugly. " * 80  # ~400 tokens: past the 256-token window

GENERATE_ARGS: list[tuple[str, list[str], int, str]] = [
    ("device-bogus", ["--device", "bogus"], USAGE, "--device: expected auto, cpu or cuda"),
    ("device-meta", ["--device", "meta"], USAGE, "--device"),
    ("device-mps", ["--device", "mps"], USAGE, "--device"),
    ("prompt-lone-surrogate", ["--prompt", "a\udcffb"], USAGE, "expected UTF-8 text"),
    ("top-p-out-of-range", ["--top-p", "2"], USAGE, "top_p"),
    ("max-new-tokens-zero", ["--max-new-tokens", "0"], USAGE, "max_new_tokens"),
    ("max-new-tokens-negative", ["--max-new-tokens", "-5"], USAGE, "max_new_tokens"),
    ("temperature-nan", ["--temperature", "nan"], USAGE, "temperature"),
    ("prompt-blank", ["--prompt", "   "], USAGE, "--prompt: expected some text"),
    ("prompt-past-the-context", ["--prompt", LONG_PROMPT], USAGE, f"context window {CONTEXT}"),
    ("deep-schema", ["--schema", "DEEP"], DATA, "nested too deeply"),
    ("model-missing", ["--model-path", "MISSING"], DATA, "MISSING"),
]


def _deep_schema(folder: Path) -> Path:
    schema: dict = {"type": "object", "properties": {}}
    node = schema
    for _ in range(200):
        child: dict = {"type": "object", "properties": {}}
        node["properties"]["a"] = child
        node = child
    path = folder / "deep.json"
    path.write_text(json.dumps(schema))
    return path


@pytest.mark.parametrize(
    ("args", "want", "needle"),
    [case[1:] for case in GENERATE_ARGS],
    ids=[case[0] for case in GENERATE_ARGS],
)
def test_bad_generate_input_is_one_line(
    cli: WarmCli, ckpt: Path, home: Path, tmp_path: Path, args: list[str], want: int, needle: str
) -> None:
    model: Path = ckpt
    if args[:1] == ["--model-path"]:  # the model argument itself
        model, args = tmp_path / "no-such-model", []
        needle = str(model)
    args = [str(_deep_schema(tmp_path)) if a == "DEEP" else a for a in args]
    base = ["--max-new-tokens", "2"] if "--max-new-tokens" not in args else []
    if "--prompt" not in args:
        base += ["--prompt", "hi"]
    _check(cli.run("generate", model, *base, *args, home=home), want, needle)


@pytest.fixture(scope="module")
def fitting(cli: WarmCli, ckpt: Path, seed_home: Path, tmp_path_factory) -> tuple[int, Ran]:
    """(tokens that fit after the prompt "hi", the run asking for exactly that many)."""
    home = _seeded(seed_home, tmp_path_factory.mktemp("fit") / "home")
    probe = cli.run("generate", ckpt, "--prompt", "hi", "--max-new-tokens", "1", "--json",
                    home=home)  # fmt: skip
    fits = CONTEXT - json.loads(probe.out)["prompt_tokens"]
    exact = cli.run("generate", ckpt, "--prompt", "hi", "--max-new-tokens", str(fits), "--json",
                    home=home)  # fmt: skip
    assert exact.code == 0 and exact.lines == [], exact.err  # it fits: nothing to warn about
    return fits, exact


@pytest.mark.parametrize("past", [1, 5000], ids=["one-past", "far-past"])
def test_max_new_tokens_past_the_context_is_one_warning(
    cli: WarmCli, ckpt: Path, home: Path, fitting: tuple[int, Ran], past: int
) -> None:
    """--max-new-tokens beyond the window: one warning line before generating, then exactly
    what asking for the tokens that fit generates."""
    fits, exact = fitting
    asked = fits + past
    ran = cli.run("generate", ckpt, "--prompt", "hi", "--max-new-tokens", str(asked), "--json",
                  home=home)  # fmt: skip
    prompt = CONTEXT - fits
    assert ran.code == 0 and "Traceback" not in ran.err, ran.err
    assert ran.lines == [
        f"warning: --max-new-tokens {asked}: only {fits} tokens fit after the {prompt}-token "
        f"prompt in the {CONTEXT}-token context window; generating at most {fits}"
    ]
    got, want = json.loads(ran.out), json.loads(exact.out)
    assert (got["tokens"], got["finish_reason"]) == (want["tokens"], want["finish_reason"])


# ------------------------------------------------------------------------------------ roofline

ROOFLINE_CONFIGS = [
    ("not-json", "not json", "expected a JSON object"),
    ("empty", "", "expected a JSON object"),
    ("a-list", "[1]", "expected a JSON object, got list"),
    ("a-string", '"x"', "expected a JSON object, got str"),
    ("a-number", "3", "expected a JSON object, got int"),
    ("null", "null", "expected a JSON object, got NoneType"),
    ("missing-fields", '{"model_type": "llama"}', "expected"),
    ("unknown-family", '{"model_type": "gpt-neox"}', "expected"),
    ("a-folder-without-config", None, "expected a config.json file"),
]


@pytest.mark.parametrize(
    ("text", "needle"), [c[1:] for c in ROOFLINE_CONFIGS], ids=[c[0] for c in ROOFLINE_CONFIGS]
)
def test_a_bad_roofline_config_is_one_line(
    cli: WarmCli, home: Path, tmp_path: Path, text: str | None, needle: str
) -> None:
    cfg = tmp_path / "config.json"
    if text is None:
        cfg = tmp_path / "empty-model"
        cfg.mkdir()
    else:
        cfg.write_text(text)
    _check(cli.run("roofline", cfg, home=home), DATA, needle)


# ------------------------------------------------------------------- eval, lm-eval: bad input


def _bench_rows(task: str) -> list[dict]:
    if task == "lambada_openai":
        return [{"context": f"Simple is better than {w} and", "continuation": w}
                for w in ("apple", "river", "stone")]  # fmt: skip
    choices = ["apple", "river", "stone", "cloud"]
    return [{"query": f"Question: which word is number {i}?", "choices": choices, "gold": i}
            for i in range(3)]  # fmt: skip


# (id, task file, the change to item 1, needle). The "wrong result" ones used to pass the check
# and be scored as something else (true as choice 1, a string of letters as its characters).
EVAL_ROWS: list[tuple[str, str, dict, str]] = [
    ("gold-a-string", "arc_easy", {"gold": "b"}, "item 1: expected gold as an integer index, "
     "got str 'b'"),
    ("gold-past-the-choices", "arc_easy", {"gold": 4}, "item 1: expected gold in [0, 4), got 4"),
    ("gold-negative", "arc_easy", {"gold": -1}, "expected gold in [0, 4), got -1"),
    ("gold-missing", "arc_easy", {"gold": None}, "missing gold"),
    ("wrong-result-gold-true", "arc_easy", {"gold": True}, "got bool True"),
    ("wrong-result-gold-numeric-string", "arc_easy", {"gold": "1"}, "got str '1'"),
    ("wrong-result-gold-float", "arc_easy", {"gold": 1.0}, "got float 1.0"),
    ("wrong-result-choices-a-string", "arc_easy", {"choices": "abcd"}, "expected choices as a "
     "non-empty list, got str"),
    ("choices-empty", "arc_easy", {"choices": []}, "expected choices as a non-empty list"),
    ("query-null", "arc_easy", {"query": None}, "expected query as text, got NoneType None"),
    ("continuation-a-number", "lambada_openai", {"continuation": 7},
     "expected continuation as text, got int 7"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("task", "change", "needle"), [c[1:] for c in EVAL_ROWS], ids=[c[0] for c in EVAL_ROWS]
)
def test_a_bad_benchmark_row_is_one_line(
    cli: WarmCli, ckpt: Path, tiny_model_dir: Path, home: Path, tmp_path: Path,
    task: str, change: dict, needle: str,
) -> None:  # fmt: skip
    rows = _bench_rows(task)
    rows[1].update(change)
    rows[1] = {k: v for k, v in rows[1].items() if v is not None or k != "gold"}
    (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    short = "lambada" if task == "lambada_openai" else task
    ran = cli.run(
        "eval", ckpt, "--reference", tiny_model_dir, "--tasks", short, "--data-dir", tmp_path,
        "--limit", "2", "--ppl-tokens", "0", "--no-progress", home=home,
    )  # fmt: skip
    _check(ran, DATA, needle)
    assert "[1/2]" not in ran.err, ran.err  # refused before the reference model loads


LIMITS = [
    ("lm-eval-limit-zero", "lm-eval", "0", "--limit: expected a count of items >= 1 or a "
     "fraction in (0, 1), got 0"),
    ("lm-eval-limit-negative", "lm-eval", "-3", "got -3"),
    ("lm-eval-limit-nan", "lm-eval", "nan", "got nan"),
    ("lm-eval-limit-not-whole", "lm-eval", "2.5", "got 2.5"),
    ("eval-limit-zero", "eval", "0", "--limit: expected an integer >= 1, got 0"),
    ("eval-limit-negative", "eval", "-1", "--limit: expected an integer >= 1, got -1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "limit", "needle"), [c[1:] for c in LIMITS], ids=[c[0] for c in LIMITS]
)
def test_a_limit_of_no_items_is_one_line(
    cli: WarmCli, ckpt: Path, home: Path, command: str, limit: str, needle: str
) -> None:
    if command == "lm-eval":
        args = ["--model_args", f"pretrained={ckpt}", "--tasks", "quantkit_arc_easy"]
    else:
        args = [str(ckpt), "--reference", str(ckpt), "--tasks", "arc_easy"]
    _check(cli.run(command, *args, "--limit", limit, home=home), USAGE, needle)


def test_lm_eval_without_a_model_is_one_line(cli: WarmCli, home: Path) -> None:
    ran = cli.run("lm-eval", "--tasks", "quantkit_arc_easy", "--limit", "2", home=home)
    _check(ran, DATA, "expected pretrained=CHECKPOINT")


def test_bench_plot_at_a_file_fails_before_benchmarking(
    cli: WarmCli, ckpt: Path, home: Path, tmp_path: Path
) -> None:
    """`bench --plot PATH` where PATH is a file: refused before any model loads (it used to
    run the whole benchmark first)."""
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots.png"
    plots.write_text("an existing file\n")
    started = time.monotonic()
    ran = cli.run("bench", ckpt, "--plot", plots, "--requests", "2", home=home)
    _check(ran, USAGE, "--plot: expected a directory")
    assert time.monotonic() - started < 20 and plots.read_text() == "an existing file\n"


# --------------------------------------------------------------- grammar: the cache on disk

# Two regexes and two schemas (outlines-core, so their indexes are cached), whose clean-cache
# runs every damaged run must reproduce. Closed schemas: a random tiny model fills an open one
# with undeclared properties until the token limit.
GRAMMARS: dict[str, list[str]] = {
    "regex-a": ["--prompt", "A number:", "--regex", "[0-9]{3}"],
    "regex-b": ["--prompt", "A number:", "--regex", "[a-f]{2}-[0-9]"],
    "schema-a": ["--prompt", "Set it.", "--schema", "SCHEMA_A", "--grammar-engine", "outlines"],
    "schema-b": ["--prompt", "Set it.", "--schema", "SCHEMA_B", "--grammar-engine", "outlines"],
}
SCHEMAS = {
    "SCHEMA_A": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False},
    "SCHEMA_B": {"type": "object", "properties": {"level": {"enum": ["low", "high"]}},
                 "required": ["level"], "additionalProperties": False},
}  # fmt: skip
ROLES = ("index", "plan-index", "vocab", "byte-vocab")


@dataclass(frozen=True)
class CleanRun:
    """A grammar's run on an empty cache: its arguments, what it printed, and the cache it
    left (role -> file name: the token index, the byte-level plan index, the two vocabularies)."""

    args: list[str]
    ran: Ran
    cache: Path
    files: dict[str, str]


def _grammar_args(name: str, folder: Path) -> list[str]:
    args = []
    for arg in GRAMMARS[name]:
        if arg in SCHEMAS:
            path = folder / f"{arg.lower()}.json"
            path.write_text(json.dumps(SCHEMAS[arg]))
            arg = str(path)
        args.append(arg)
    return [*args, "--max-new-tokens", "24", "--json"]


def _cache_roles(name: str, cache: Path) -> dict[str, str]:
    """Which file in `cache` is which: the plan index and the byte vocabulary are the ones
    keyed by the byte-level vocabulary."""
    from quantkit.grammar.budget import byte_vocabulary
    from quantkit.grammar.cache_file import entry_key
    from quantkit.grammar.compiler import compile_grammar
    from quantkit.grammar.constraints import regex_grammar, schema_grammar

    source = GRAMMARS[name]
    grammar = (
        regex_grammar(source[source.index("--regex") + 1])
        if "--regex" in source
        else schema_grammar(SCHEMAS[source[source.index("--schema") + 1]])
    )
    plan = compile_grammar(grammar, byte_vocabulary(), engine="outlines", timeout_s=None,
                           cache=False, plan=False).key  # fmt: skip
    byte_vocab = f"vocab-{entry_key('vocab', byte_vocabulary().fingerprint)[:32]}.bin"
    indexes = sorted(p.name for p in cache.glob("*.index"))
    vocabs = sorted(p.name for p in cache.glob("vocab-*.bin"))
    assert f"{plan}.index" in indexes and byte_vocab in vocabs and len(indexes + vocabs) == 4
    return {
        "index": next(n for n in indexes if n != f"{plan}.index"),
        "plan-index": f"{plan}.index",
        "vocab": next(n for n in vocabs if n != byte_vocab),
        "byte-vocab": byte_vocab,
    }


@pytest.fixture(scope="module")
def clean_runs(
    cli: WarmCli, ckpt: Path, seed_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, CleanRun]:
    runs = {}
    for name in GRAMMARS:
        folder = tmp_path_factory.mktemp(f"clean-{name}")
        home = _seeded(seed_home, folder / "home")
        args = _grammar_args(name, folder)
        ran = cli.run("generate", ckpt, *args, home=home)
        assert ran.code == 0 and json.loads(ran.out)["output_valid"], ran.err
        cache = shutil.copytree(home / "grammar", folder / "cache")
        runs[name] = CleanRun(args, ran, cache, _cache_roles(name, cache))
    return runs


def _truncated(path: Path, _other: Path) -> None:
    path.write_bytes(path.read_bytes()[:-16])


def _emptied(path: Path, _other: Path) -> None:
    path.write_bytes(b"")


def _garbage(path: Path, _other: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


def _flipped(path: Path, _other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the payload: only the digest can tell
    path.write_bytes(bytes(data))


def _other_entry(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)


DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "truncated": _truncated,
    "emptied": _emptied,
    "garbage": _garbage,
    "bit-flipped": _flipped,
    "from-another-entry": _other_entry,
}
# (grammar, role, damage): every damage of every kind of entry for a regex, and for a schema
# (lowered to a regex first) a truncated index and one copied from another schema's index.
CACHE_CASES = [("regex-a", role, damage) for role in ROLES for damage in DAMAGES] + [
    ("schema-a", "index", "truncated"),
    ("schema-a", "index", "from-another-entry"),
]


def _other(runs: dict[str, CleanRun], name: str, role: str) -> Path:
    """What a misplaced entry is a copy of: the same kind of entry of the other grammar (an
    index) or the other vocabulary (a vocabulary: the two share this model's grammar)."""
    if role.endswith("vocab"):
        twin = "byte-vocab" if role == "vocab" else "vocab"
        return runs[name].cache / runs[name].files[twin]
    other = runs[name.replace("-a", "-b")]
    return other.cache / other.files[role]


def _header_key(path: Path) -> str:
    return path.read_bytes().split(b"\n", 1)[0].decode().split(" ")[3]


def _result(ran: Ran) -> tuple:
    got = json.loads(ran.out)
    return got["text"], got["tokens"], got["finish_reason"], got["output_valid"]


@pytest.mark.parametrize(
    ("name", "role", "damage"), CACHE_CASES, ids=["-".join(c) for c in CACHE_CASES]
)
def test_a_damaged_grammar_cache_entry_is_rebuilt_with_one_warning(
    cli: WarmCli, ckpt: Path, home: Path, clean_runs: dict[str, CleanRun],
    name: str, role: str, damage: str,
) -> None:  # fmt: skip
    from quantkit.grammar.cache_file import read_entry

    clean = clean_runs[name]
    cache = shutil.copytree(clean.cache, home / "grammar")
    entry = cache / clean.files[role]
    if role.endswith("vocab"):  # a vocabulary is read only to compile: drop the indexes
        for index in cache.glob("*.index"):
            index.unlink()
    DAMAGES[damage](entry, _other(clean_runs, name, role))
    ran = cli.run("generate", ckpt, *clean.args, home=home)
    assert ran.code == 0 and "Traceback" not in ran.err, ran.err
    assert _result(ran) == _result(clean.ran)
    warnings = [ln for ln in ran.lines if ln.startswith("grammar cache:")]
    assert len(warnings) == 1, ran.err
    assert warnings[0].startswith(f"grammar cache: {entry} is damaged (")
    assert warnings[0].endswith("); rebuilding")
    assert [ln for ln in ran.lines if ln not in warnings] == clean.ran.lines
    # Rebuilt whole, for the right key, and nothing half-written beside it.
    key = _header_key(entry)
    assert entry.name in (f"{key[:32]}.index", f"vocab-{key[:32]}.bin")
    read_entry(entry, kind="vocab" if role.endswith("vocab") else "index", key=key)
    assert not list(cache.glob("*.tmp-*"))


def test_a_clean_cache_is_read_without_a_word(
    cli: WarmCli, ckpt: Path, home: Path, clean_runs: dict[str, CleanRun]
) -> None:
    clean = clean_runs["regex-a"]
    shutil.copytree(clean.cache, home / "grammar")
    ran = cli.run("generate", ckpt, *clean.args, home=home)
    assert ran.code == 0 and ran.lines == clean.ran.lines, ran.err
    assert _result(ran) == _result(clean.ran)
    assert json.loads(ran.out)["compile_source"] == "disk"


def test_a_killed_writers_temporary_index_is_swept(
    cli: WarmCli, ckpt: Path, home: Path, clean_runs: dict[str, CleanRun]
) -> None:
    """Leftovers: a half-written index of a compile killed an hour ago goes at the next
    compile; the run is the clean one, without a warning."""
    cache = home / "grammar"
    cache.mkdir()
    stale = cache / "0123456789abcdef0123456789abcdef.index.tmp-999999"
    stale.write_bytes(b"half an index")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    clean = clean_runs["regex-a"]
    ran = cli.run("generate", ckpt, *clean.args, home=home)
    assert ran.code == 0 and ran.lines == clean.ran.lines, ran.err
    assert _result(ran) == _result(clean.ran) and not stale.exists()


# ----------------------------------------------------------------------- disk and file system


def test_quantize_under_a_file_fails_before_any_work(
    cli: WarmCli, tiny_model_dir: Path, home: Path, tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("")
    ran = cli.run("quantize", tiny_model_dir, "--method", "rtn", "-o", tmp_path / "afile/x",
                  home=home)  # fmt: skip
    _check(ran, DATA, "got a file")
    assert "perplexity" not in ran.out + ran.err  # refused before quantizing, not after


def _home_a_file(home: Path) -> dict[str, str]:
    shutil.rmtree(home)
    home.write_text("")
    return {}


def _grammar_folder_a_file(home: Path) -> dict[str, str]:
    (home / "grammar").write_text("")
    return {}


# (id, what to break in the home, arguments after the checkpoint, class, needle)
FILE_SYSTEM: list[tuple[str, Callable[[Path], dict[str, str]], list[str], int, str]] = [
    ("home-is-a-file", _home_a_file, ["--prompt", "hi"], ENVIRONMENT, "not a directory"),
    (
        "grammar-cache-is-a-file",
        _grammar_folder_a_file,
        ["--prompt", "hi", "--regex", "[0-9]+", "--grammar-engine", "outlines"],
        ENVIRONMENT,
        "grammar cache: expected a folder at",
    ),
    (
        "output-in-a-missing-folder",
        lambda home: {},
        ["--prompt", "hi", "--output", "MISSING/out.txt"],
        USAGE,
        "expected an existing folder",
    ),
    (
        "output-is-a-directory",
        lambda home: {},
        ["--prompt", "hi", "--output", "HOME"],
        ENVIRONMENT,
        "is a directory",
    ),
]


@pytest.mark.parametrize(
    ("breakage", "args", "want", "needle"),
    [c[1:] for c in FILE_SYSTEM],
    ids=[c[0] for c in FILE_SYSTEM],
)
def test_a_file_system_in_the_way_is_one_line(
    cli: WarmCli, ckpt: Path, home: Path, tmp_path: Path, breakage, args, want, needle
) -> None:
    breakage(home)
    args = [str(tmp_path / "missing/out.txt") if a == "MISSING/out.txt" else a for a in args]
    args = [str(tmp_path) if a == "HOME" else a for a in args]
    ran = cli.run("generate", ckpt, "--max-new-tokens", "2", *args, home=home)
    _check(ran, want, needle)


def test_a_full_disk_while_writing_output_keeps_the_old_file(
    cli: WarmCli, ckpt: Path, home: Path, tmp_path: Path
) -> None:
    """ulimit -f 200 bytes: the new output (200 tokens) cannot be written; the old one stays
    whole and no temporary file is left beside it."""
    out = tmp_path / "answer.txt"
    out.write_text("the old answer\n")
    ran = cli.run("generate", ckpt, "--prompt", "hi", "--max-new-tokens", "200", "--output", out,
                  home=home, fsize=200, stdout=False)  # fmt: skip
    _check(ran, ENVIRONMENT, "file too large")
    assert out.read_text() == "the old answer\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".answer")] == []


def test_a_full_disk_while_writing_a_checkpoint_is_one_line(
    cli: WarmCli, tiny_model_dir: Path, home: Path, tmp_path: Path
) -> None:
    target = tmp_path / "out"
    ran = cli.run("quantize", tiny_model_dir, "--method", "rtn", "--eval-tokens", "0", "-o",
                  target, home=home, fsize=64 * 1024)  # fmt: skip
    assert not target.exists() and not [p for p in tmp_path.iterdir() if ".out." in p.name]
    _check(ran, ENVIRONMENT, "file too large")


def test_a_full_disk_under_force_keeps_the_old_checkpoint(
    cli: WarmCli, tiny_model_dir: Path, ckpt: Path, home: Path, tmp_path: Path
) -> None:
    """A real write limit (ulimit -f: the shard write fails with EFBIG) during `quantize
    --force` over an existing checkpoint: one line, exit 4, the old checkpoint byte-identical
    and still loadable, no temporary directory left."""
    from quantkit.runtime.loader import load_model

    target = _copy(ckpt, tmp_path / "keep")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in target.iterdir()}
    ran = cli.run("quantize", tiny_model_dir, "--method", "rtn", "--eval-tokens", "0", "-o",
                  target, "--force", home=home, fsize=64 * 1024)  # fmt: skip
    _check(ran, ENVIRONMENT, "file too large")
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in target.iterdir()}
    assert after == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keep")], "temp left behind"
    load_model(target, tokenizer=False)


# --------------------------------------------------------------------------------- interrupts

SLOW_REGEX = r'"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]){0,64}"'  # minutes of index build


def test_ctrl_c_during_a_grammar_compile_is_one_line(cli: WarmCli, ckpt: Path, home: Path) -> None:
    """SIGINT while the compile worker builds the index: the parent's second wait on the
    worker (the first is for its start-up) is the wait for the answer."""
    ran = cli.run(
        "generate", ckpt, "--prompt", "hi", "--regex", SLOW_REGEX, "--grammar-engine", "outlines",
        "--compile-timeout", "600", "--max-new-tokens", "4", home=home,
        interrupt_at="quantkit.grammar.worker_client:_Worker._read#2",
    )  # fmt: skip
    assert "Traceback" not in ran.err, ran.err
    assert ran.code == INTERRUPTED and ran.lines[-1] == "interrupted; nothing was written"
    assert ran.lines[:-1] == [ln for ln in ran.lines[:-1] if ln.startswith("compiling ")]
    leftovers = list((home / "grammar").glob("*.tmp-*")) + list((home / "grammar").glob("*.index"))
    assert leftovers == [] and ran.out == ""


@pytest.mark.parametrize(
    "where",
    [
        "quantkit.quantize.streaming:stream_quantize",  # the quantization starts
        "quantkit.format.checkpoint:save_shard",  # the first layer's file is being written
    ],
)
def test_ctrl_c_during_quantize_writes_nothing(
    cli: WarmCli, tiny_model_dir: Path, home: Path, tmp_path: Path, where: str
) -> None:
    (tmp_path / "models").mkdir()
    target = tmp_path / "models" / "out"
    ran = cli.run("quantize", tiny_model_dir, "--method", "rtn", "--eval-tokens", "0", "-o",
                  target, home=home, interrupt_at=where)  # fmt: skip
    assert "Traceback" not in ran.err, ran.err
    _check(ran, INTERRUPTED, "interrupted; nothing was written")
    assert list((tmp_path / "models").iterdir()) == []  # no checkpoint, no temporary folder


def test_ctrl_c_after_finished_layers_keeps_them_for_the_next_run(
    cli: WarmCli, tiny_model_dir: Path, home: Path, tmp_path: Path
) -> None:
    """Every layer is done when Ctrl-C lands: the one line says where they wait, and the same
    command finishes from them."""
    target = tmp_path / "out"
    args = ("quantize", tiny_model_dir, "--method", "rtn", "--eval-tokens", "0", "-o", target)
    ran = cli.run(*args, home=home, interrupt_at="quantkit.quantize.staging:Staging.save_outer")
    _check(ran, INTERRUPTED, "interrupted; 2 finished layer(s) kept in ")
    assert "run the same command again to resume" in ran.lines[0]
    again = cli.run(*args, home=home)
    assert again.code == 0 and "resumed      at layer 2" in again.out, again.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out"]


def test_ctrl_c_during_imports_is_one_line(tmp_path: Path) -> None:
    """SIGINT as torch's import starts: exit 130, one line (a fresh interpreter: the imports
    are what is interrupted). The shutdown phases after it: tests/test_cli_interrupts.py."""
    from tests.test_cli_interrupts import run_interrupted

    ran = run_interrupted("inspect", tmp_path, folder=tmp_path, first="torch", timeout_s=60)
    assert ran.sent == ["import torch"]  # the signal landed in the imports, as planned
    err = ran.err
    assert "Traceback" not in err, err
    assert ran.code == INTERRUPTED, (ran.code, err)
    assert err.strip() == "interrupted; nothing was written"


# ---------------------------------------------------------------------------------- leftovers


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_quantizes_leftovers_are_swept_by_the_next(
    cli: WarmCli, tiny_model_dir: Path, home: Path, tmp_path: Path
) -> None:
    pid = _dead_pid()
    half = tmp_path / f".out.tmp-{pid}-deadbeef"  # SIGKILL mid-write
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 1000)
    ran = cli.run("quantize", tiny_model_dir, "--method", "rtn", "--eval-tokens", "0", "-o",
                  tmp_path / "out", home=home)  # fmt: skip
    assert ran.code == 0 and "Traceback" not in ran.err, ran.err
    swept = [ln for ln in ran.lines if half.name in ln]  # one line, not Python's two
    assert swept == [ln for ln in ran.lines if "warning" in ln.lower()], ran.err
    assert len(swept) == 1 and swept[0].startswith("warning: removed "), ran.err
    assert f"removed {half.name}, left by an interrupted write" in swept[0]
    assert not half.exists() and (tmp_path / "out" / "config.json").is_file()


# ------------------------------------------------------------ options that used to slip through

SLIPPED = [
    ("seed-past-64-bits", ["--seed", str(2**70)], "--seed"),
    ("timeout-inf", ["--regex", "a+", "--compile-timeout", "inf"], "--compile-timeout"),
    ("timeout-nan", ["--regex", "a+", "--compile-timeout", "nan"], "--compile-timeout"),
    ("regex-empty", ["--regex", ""], "--regex: expected a non-empty value"),
    ("schema-empty", ["--schema", ""], "--schema: expected a non-empty value"),
    ("regex-and-choice", ["--regex", "a+", "--choice", "x"], "expected at most one of"),
    ("regex-invalid", ["--regex", "(ab"], "expected a valid regex"),
]


@pytest.mark.parametrize(("args", "needle"), [c[1:] for c in SLIPPED], ids=[c[0] for c in SLIPPED])
def test_options_that_used_to_slip_through(
    cli: WarmCli, ckpt: Path, home: Path, args: list[str], needle: str
) -> None:
    ran = cli.run("generate", ckpt, "--prompt", "hi", "--max-new-tokens", "2", *args, home=home)
    _check(ran, USAGE, needle)
    assert ran.out == ""  # nothing generated, constrained or not


# ------------------------------------------------------------- in-process: faults injected


def test_force_over_an_existing_checkpoint_survives_a_failed_write(
    tiny_model_dir: Path, ckpt: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The old checkpoint is byte-identical after a write that failed midway (disk full)."""
    from quantkit.format import checkpoint

    target = _copy(ckpt, tmp_path / "keep")

    def digest() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in target.iterdir()}

    before = digest()

    def disk_full(*_a, **_k):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device", str(target) + ".tmp")

    monkeypatch.setattr(checkpoint, "_write_tensors", disk_full)
    code, out, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), "--method", "rtn", "-o", str(target), "--force",
        "--eval-tokens", "0",
    )  # fmt: skip
    _check(Ran(code, out, err), ENVIRONMENT, "no space left on the device")
    assert digest() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keep")], "temp left behind"


def test_an_unexpected_error_is_one_line_and_a_log(ckpt: Path, tmp_path: Path, capsys, monkeypatch):
    from quantkit.cli import inspect_cmd

    def boom(*_a, **_k):  # type: ignore[no-untyped-def]
        raise RuntimeError("something nobody expected")

    monkeypatch.setattr(inspect_cmd, "load_checkpoint", boom)
    code, _, err = run_cli(capsys, "inspect", str(ckpt))
    lines = err.strip().splitlines()
    assert code == BUG and len(lines) == 1 and "Traceback" not in err, err
    assert "internal error: RuntimeError: something nobody expected" in lines[0]
    log = Path(lines[0].split("traceback in ")[1].split(";")[0])
    assert log.is_file() and "Traceback" in log.read_text() and "boom" in log.read_text()


def test_a_damaged_kernel_library_is_rebuilt_with_one_warning(tmp_path: Path) -> None:
    from quantkit.fused_kernels.cpu import build as cpu_build

    source = "int answer(void) { return 42; }\n"
    lib = cpu_build.build_library("hostile", source)
    size = lib.stat().st_size
    for damage in (lambda d: d[: len(d) // 3], lambda d: b"", lambda d: os.urandom(len(d))):
        lib.write_bytes(damage(lib.read_bytes()))
        with pytest.warns(UserWarning, match="kernel cache .* damaged .* rebuilding") as seen:
            again = cpu_build.build_library("hostile", source)
        assert len(seen) == 1 and again == lib and lib.stat().st_size == size
    # Loaded in a fresh process: a library this process mapped must not be rewritten under it.
    code = f"import ctypes; print(ctypes.CDLL({str(lib)!r}).answer())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "42", out.stderr


def test_grammar_cache_entries_tell_every_damage_apart(tmp_path: Path) -> None:
    """The header check itself, each damage named: what the one warning line says."""
    from quantkit.grammar.cache_file import DamagedEntryError, read_entry, write_entry

    path, key = tmp_path / "x.index", "ab" * 32
    write_entry(path, b"payload bytes", kind="index", key=key)
    assert read_entry(path, kind="index", key=key) == b"payload bytes"
    whole = path.read_bytes()
    damages = {
        b"": "got an empty file",
        whole[:20]: "expected a whole header line",
        whole[:-1]: "expected 13 payload bytes, got 12",
        whole + b"!": "expected 13 payload bytes, got 14",
        whole[:-1] + b"X": "SHA-256",
        b"\x89PNG" + whole: "expected a QKGRAMMAR header",
        whole.replace(b" 1 index ", b" 9 index "): "expected format 1, got format 9",
    }
    for data, why in damages.items():
        path.write_bytes(data)
        with pytest.raises(DamagedEntryError, match=re.escape(why)):
            read_entry(path, kind="index", key=key)
    path.write_bytes(whole)
    with pytest.raises(DamagedEntryError, match="expected a vocab entry, got a index entry"):
        read_entry(path, kind="vocab", key=key)
    with pytest.raises(DamagedEntryError, match="expected an entry built for key cdcdcdcdcdcd"):
        read_entry(path, kind="index", key="cd" * 32)
    assert [p.name for p in tmp_path.iterdir()] == ["x.index"]  # no temporary file left


def test_leftovers_of_a_killed_writer_are_swept_and_nothing_is_lost(tmp_path: Path) -> None:
    from quantkit.paths import sweep_leftovers

    target = tmp_path / "ckpt"
    pid = _dead_pid()
    half = tmp_path / f".ckpt.tmp-{pid}-deadbeef"  # SIGKILL mid-write
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 1000)
    moved = tmp_path / f".ckpt.old-{pid}-cafef00d"  # SIGKILL between the two renames
    moved.mkdir()
    (moved / "config.json").write_text("{}")
    live = tmp_path / f".ckpt.tmp-{os.getpid()}-0badf00d"  # a writer still running: untouched
    live.mkdir()
    done = sweep_leftovers(target)
    assert not half.exists() and live.exists()
    assert (target / "config.json").read_text() == "{}" and not moved.exists()
    assert any("restored" in line for line in done) and any("removed" in line for line in done)


def test_ctrl_c_while_the_old_checkpoint_is_deleted_finishes_the_deletion(
    tmp_path: Path, monkeypatch
) -> None:
    from quantkit import paths

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    new = tmp_path / "new"
    new.mkdir()
    (new / "new.bin").write_bytes(b"new")
    removed = paths._remove

    def slow_remove(path: Path) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C mid-deletion
        removed(path)

    monkeypatch.setattr(paths, "_remove", slow_remove)
    monkeypatch.setattr(paths, "WRITTEN", [])
    with pytest.raises(KeyboardInterrupt):
        paths.replace_dir(new, target)
    assert (target / "new.bin").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no half-deleted .old- left
    assert paths.WRITTEN == [target]


def test_a_checkpoint_gets_the_permissions_of_an_ordinary_file(ckpt: Path) -> None:
    """safetensors writes 0600: the checkpoint's files get what open() would give (umask
    applied), so the other users of a machine can read a checkpoint (it was 0600 before)."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in ckpt.iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes
    assert ckpt.stat().st_mode & 0o777 == 0o777 & ~umask


def test_atomic_files_are_whole_or_absent_with_ordinary_permissions(tmp_path: Path) -> None:
    """Every single-file writer (generate --output, bench --json and --plot, the calibration
    cache) goes through `paths.atomic_file`: the result has what open() would give (mkstemp's
    0600 before), and a failure leaves the old file and no temporary one."""
    from quantkit import paths
    from quantkit.cli.grammar_run import write_atomic
    from quantkit.evals.common import write_json_atomic

    umask = os.umask(0)
    os.umask(umask)
    answer, report = tmp_path / "answer.json", tmp_path / "report.json"
    write_atomic(answer, '{"a": 1}')
    write_json_atomic(report, {"rows": [1, 2]})
    assert answer.read_text() == '{"a": 1}\n' and json.loads(report.read_text()) == {"rows": [1, 2]}
    for path in (answer, report):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    with pytest.raises(RuntimeError), paths.atomic_file(answer) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the disk went away")
    assert answer.read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.json", "report.json"]
