"""Everything quantkit checks on a CUDA machine, in one run: `python -m quantkit.evals.gpu_check`.

A GPU is a scarce, timed resource here, so one command does it all, each stage in its own
process under its own time limit (one stage failing, hanging or running out of memory does not
cost the others), inside an overall deadline, and prints one table at the end:

1. `tests`: the tests marked `gpu` (compiled Triton kernels against the reference, INT4 / FP8 /
   FP4; every quantization algorithm on the GPU as good as on the CPU);
2. `synthetic`: a random-weight checkpoint of a real model's shape (Llama-3.1-8B by default, cut
   to --layers), made on the host while the tests run;
3. `awq`, `gptq`: `quantkit quantize --device cuda` of it, per-layer time and peak memory;
4. `generate`, `compiled`: greedy decode of the AWQ checkpoint on the GPU (Triton kernels), tok/s
   and MBU, eager and with `--compile`;
5. `kernels`: the W4A16 / FP8 kernel benchmark at the 8B shapes against dense bf16;
6. `sweep`: every W4A16 GEMV candidate alone (`kernels.gemv_sweep`, CUDA-graph replay).

Every stage's output goes to --log; the table says what each stage measured. Nothing here is
needed on a CPU machine: the test suite runs the same code paths on the CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.evals.common import run_main

PY = sys.executable


@dataclass
class Stage:
    name: str
    argv: list[str]
    limit: float  # seconds
    parse: str = ""  # how to read its numbers: a key of _PARSERS
    rc: int | None = None
    seconds: float = 0.0
    output: str = ""
    numbers: dict[str, str] = field(default_factory=dict)


def _stages(work: Path, args: argparse.Namespace) -> tuple[Stage, list[Stage]]:
    model = work / f"{args.shape}-{args.layers}l"
    cli = [PY, "-m", "quantkit.cli.main"]
    synth = Stage(
        "synthetic",
        [PY, "-m", "quantkit.evals.synthetic", "--shape", args.shape, "--layers",
         str(args.layers), "-o", str(model), "--force",
         *(["--tokenizer", str(args.tokenizer)] if args.tokenizer else [])],
        args.synthetic_limit,
    )  # fmt: skip
    quantize = [*cli, "quantize", str(model), "--device", args.device, "--eval-tokens", "0"]
    quantize += ["--calib", str(args.calib)] if args.calib else []
    after = [
        Stage(
            "tests",
            [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
             *args.tests.split(",")],
            args.tests_limit, "pytest",
        ),
        Stage("awq", [*quantize, "--method", "awq", "-o", str(work / "awq"), "--force"],
              args.quantize_limit, "quantize"),
        Stage("gptq", [*quantize, "--method", "gptq", "-o", str(work / "gptq"), "--force"],
              args.quantize_limit, "quantize"),
        Stage(
            "generate",
            [*cli, "generate", str(work / "awq"), "--device", args.device, "--prompt",
             "The history of the city", "--max-new-tokens", "128", "--temperature", "0"],
            args.generate_limit, "generate",
        ),
        Stage(
            "compiled",
            [*cli, "generate", str(work / "awq"), "--device", args.device, "--prompt",
             "The history of the city", "--max-new-tokens", "128", "--temperature", "0",
             "--compile"],
            args.generate_limit * 2, "generate",
        ),
        Stage(
            "kernels",
            [PY, "-m", "quantkit.evals.kernels.bench_w4a16", "--shapes", "llama3-8b", "--m",
             "1,16,512", "--impls", "int4,fp8,dense-bf16", "--budget", "0.2"],
            args.kernels_limit, "kernels",
        ),
        Stage(
            "sweep",
            [PY, "-m", "quantkit.evals.kernels.gemv_sweep", "--m", "1,4"],
            args.kernels_limit * 3, "sweep",
        ),
    ]  # fmt: skip
    return synth, after


def _parse_pytest(out: str) -> dict[str, str]:
    last = [
        ln
        for ln in out.splitlines()
        if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", ln)
    ]
    got = {"result": last[-1].strip("= ") if last else "no summary"}
    # What each failure asserted (the child scripts' messages name the failing case).
    failures = [ln.strip() for ln in out.splitlines() if "Error:" in ln and ln.startswith("E ")]
    got.update({f"failure{i}": ln for i, ln in enumerate(failures[-4:])})
    return got


def _parse_quantize(out: str) -> dict[str, str]:
    got: dict[str, str] = {}
    for key, pattern in (
        ("time", r"^time\s+(.*)$"),
        ("rss", r"^peak RSS\s+(\d+ MB)"),
        ("gpu", r"^device\s+(.*)$"),
        ("error", r"^(error: .*)$"),
    ):
        m = re.search(pattern, out, re.M)
        if m:
            got[key] = m.group(1)
    return got


def _parse_generate(out: str) -> dict[str, str]:
    got: dict[str, str] = {}
    for line in out.splitlines():
        # TPOT's p50 is the warm step: the mean (decode) counts the first step, which compiles
        # and autotunes the kernels in that process.
        for key in ("TPOT", "decode", "roofline", "backend", "device", "error"):
            if line.strip().startswith(key):
                got[key] = line.strip()
    return got


def _parse_kernels(out: str) -> dict[str, str]:
    rows = [ln for ln in out.splitlines() if "x" in ln and ("GB/s" in ln or "us" in ln)]
    return {f"row{i}": r for i, r in enumerate(rows[-24:])}


def _parse_sweep(out: str) -> dict[str, str]:
    rows = [ln for ln in out.splitlines() if "autotuned" in ln or "dense bf16" in ln]
    return {f"row{i}": " ".join(r.split()) for i, r in enumerate(rows)}


_PARSERS = {
    "pytest": _parse_pytest,
    "quantize": _parse_quantize,
    "generate": _parse_generate,
    "kernels": _parse_kernels,
    "sweep": _parse_sweep,
}


def _run(stage: Stage, deadline: float, log) -> None:
    limit = max(1.0, min(stage.limit, deadline - time.monotonic()))
    t0 = time.monotonic()
    print(f"--- {stage.name} (limit {limit:.0f} s): {' '.join(stage.argv)}", file=log, flush=True)
    try:
        proc = subprocess.run(
            stage.argv, capture_output=True, text=True, timeout=limit, env=_env(), check=False
        )
        stage.rc, stage.output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        stage.rc = 124
        stage.output = _text(e.stdout) + _text(e.stderr) + f"\n(timed out after {limit:.0f} s)"
    stage.seconds = time.monotonic() - t0
    if stage.parse:
        stage.numbers = _PARSERS[stage.parse](stage.output)
    print(stage.output[-20000:], file=log, flush=True)


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TQDM_DISABLE", "1")
    return env


def _environment(log) -> list[str]:
    lines = []
    try:
        import torch

        lines.append(f"torch {torch.__version__}, cuda {torch.version.cuda}")
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            lines.append(
                f"{props.name}: {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs, sm_{props.major}{props.minor}"
            )
        else:
            lines.append("no CUDA device")
        import triton

        lines.append(f"triton {triton.__version__}")
    except Exception as e:  # an environment report must not stop the checks
        lines.append(f"environment: {type(e).__name__}: {e}")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
        lines.append(smi.stdout.strip())
    print("\n".join(lines), file=log, flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quantkit.evals.gpu_check", description=__doc__)
    p.add_argument("--work", type=Path, default=Path("/tmp/quantkit-gpu-check"))
    p.add_argument("--log", type=Path, default=Path("gpu_check.log"))
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--calib", type=Path, default=None, help="calibration text (--calib)")
    p.add_argument(
        "--tests",
        default="tests/test_kernels_triton.py,tests/test_kernels_fp8_triton.py,"
        "tests/test_kernels_fp4_triton.py,tests/test_quantize_device.py",
    )
    p.add_argument("--deadline", type=float, default=480.0, help="seconds for everything")
    p.add_argument("--only", default="", help="comma-separated stage names to run")
    p.add_argument("--synthetic-limit", type=float, default=240.0)
    p.add_argument("--tests-limit", type=float, default=200.0)
    p.add_argument("--quantize-limit", type=float, default=90.0)
    p.add_argument("--generate-limit", type=float, default=45.0)
    p.add_argument("--kernels-limit", type=float, default=60.0)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.deadline
    args.work.mkdir(parents=True, exist_ok=True)
    synth, after = _stages(args.work, args)
    only = set(filter(None, args.only.split(",")))
    after = [s for s in after if not only or s.name in only]
    with open(args.log, "w") as log:
        env_lines = _environment(log)
        # The checkpoint is written on the host while the GPU tests run.
        t0 = time.monotonic()
        maker = subprocess.Popen(
            synth.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
        )
        for stage in after:
            if stage.parse == "quantize" and maker.returncode is None:
                try:
                    out, _ = maker.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    maker.kill()
                    out, _ = maker.communicate()
                synth.rc, synth.output = maker.returncode, out
                synth.seconds = time.monotonic() - t0
                print(f"--- synthetic\n{out[-3000:]}", file=log, flush=True)
            if time.monotonic() >= deadline:
                stage.output = "not run: the deadline passed"
                continue
            _run(stage, deadline, log)
        if maker.returncode is None:
            maker.kill()
    print("\n".join(env_lines))
    print(f"{'stage':<10} {'rc':>4} {'s':>6}  numbers")
    for stage in [synth, *after]:
        rc = "-" if stage.rc is None else str(stage.rc)
        first = True
        numbers = stage.numbers or {"": stage.output.strip().splitlines()[-1][:150]
                                    if stage.output.strip() else ""}  # fmt: skip
        for key, value in numbers.items():
            head = f"{stage.name:<10} {rc:>4} {stage.seconds:6.0f}" if first else " " * 22
            print(f"{head}  {key + ': ' if key else ''}{value[:160]}")
            first = False
    return 0


if __name__ == "__main__":
    run_main(main)
