"""W4A16 kernel benchmark: `python -m quantkit.evals.kernels.bench_w4a16 [--csv FILE] [...]`.

For each layer shape (N x K) and row count M it times the INT4 linear as `QuantLinear` runs it
(`prepare_int4` + call: the backend dispatch picks, cpu or triton), dense `torch.matmul` in
bf16 (and fp16 on CUDA), and the pure-torch reference, and reports the median and 20%/80%
times, the weight bytes moved per second, MBU against a copy bandwidth measured in the same
run, and TFLOPS. `--impls` adds the FP8 rows (`fp8`, `fp8-w8a8`, `scaled-mm`: see
`bench_fp8`). Decode (M = 1, 4, 16) is bandwidth-bound, prefill (M = 512, 2048)
compute-bound. It runs unchanged on CPU and CUDA.

Timing reads weights from memory, not cache: each timed sweep calls the op on enough copies of
the layer to exceed the last-level cache (--sweep-mb: 96 MB of INT4 weights on CPU, 256 MB on
CUDA), as a real decode does with one copy per layer, and reports time per call. Per-call
Python and launch overhead is included, as in an eager decode.

Copy bandwidth is STREAM-style: (bytes read + bytes written) / time of `dst.copy_(src)` on 256
MB (1 GB on CUDA). Weight bytes are what a call reads: for INT4 the packed ints + scales + zero
points, for dense the N*K weights. On CPU the large prefill products (over --max-prefill-gflop)
and the reference at Llama shapes are skipped by default, and the report says so.
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantkit.cpu import cpu_name
from quantkit.evals.common import git_commit, run_main
from quantkit.evals.kernels.bench_fp8 import FP8_IMPLS, fp8_op
from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.prepared_linear import prepare_int4
from quantkit.fused_kernels.reference.w4a16 import w4a16_linear_reference

# (name, N = out, K = in, linears of this shape per decoder layer)
SHAPE_SETS: dict[str, list[tuple[str, int, int, int]]] = {
    "smollm2": [
        ("smollm2 q/o 576x576", 576, 576, 2),
        ("smollm2 k/v 192x576", 192, 576, 2),
        ("smollm2 gate/up 1536x576", 1536, 576, 2),
        ("smollm2 down 576x1536", 576, 1536, 1),
    ],
    "llama3-8b": [
        ("llama3-8b q/o 4096x4096", 4096, 4096, 2),
        ("llama3-8b gate/up 14336x4096", 14336, 4096, 2),
        ("llama3-8b down 4096x14336", 4096, 14336, 1),
    ],
}
SMOLLM2_LAYERS = 30
DECODE_M = (1, 4, 16)
PREFILL_M = (512, 2048)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    device: str
    shape: str
    n: int
    k: int
    m: int
    impl: str
    dtype: str
    group_size: int
    median_ms: float
    p20_ms: float
    p80_ms: float
    weight_bytes: int
    weight_gbps: float
    copy_gbps: float
    mbu: float
    tflops: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[int], object],
    copies: int,
    device: torch.device,
    *,
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds per call, one sample per sweep over the `copies` (>= 5 sweeps, then until the
    budget is spent, at most 50)."""
    for c in range(copies):  # warm-up: builds, autotuning, page faults
        fn(c)
    _sync(device)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 50 and (len(samples) < 5 or time.perf_counter() - start < budget_s):
        t0 = clock()
        for c in range(copies):
            fn(c)
        _sync(device)
        samples.append((clock() - t0) / copies)
    return samples


def copy_bandwidth(
    device: torch.device, *, clock: Callable[[], float] = time.perf_counter
) -> float:
    """STREAM copy GB/s: (read + written bytes) / time, median of >= 5."""
    n = (1 << 30 if device.type == "cuda" else 256 << 20) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    samples = time_calls(lambda _: dst.copy_(src), 1, device, budget_s=0.5, clock=clock)
    return 2 * src.numel() * 4 / statistics.median(samples) / 1e9


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def versions() -> str:
    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton missing")
    return ", ".join(parts)


def _random_int4(n: int, k: int, group: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """Random compressed-tensors tensors (timing does not depend on the values)."""
    lo, hi = -(2**31), 2**31 - 1
    packed = torch.randint(lo, hi, (n, (k + 7) // 8), dtype=torch.int32, device=device)
    scale = (torch.rand(n, k // group, device=device) * 0.01 + 1e-3).to(dtype)
    zero = torch.randint(lo, hi, ((n + 7) // 8, k // group), dtype=torch.int32, device=device)
    return packed, scale, zero


def bench_shape(
    name: str,
    n: int,
    k: int,
    ms: list[int],
    *,
    device: torch.device,
    dtype: torch.dtype,
    group: int,
    impls: list[str],
    copy_gbps: float,
    budget_s: float,
    max_prefill_gflop: float,
    sweep_bytes: int,
    skipped: list[str],
    clock: Callable[[], float] = time.perf_counter,
) -> list[Row]:
    int4_bytes = n * ((k + 7) // 8) * 4 + n * (k // group) * dtype.itemsize + (n + 7) // 8 * 4
    copies = max(1, min(4096, math.ceil(sweep_bytes / int4_bytes)))
    scheme = QuantScheme("int4", group_size=group)
    layers = [_random_int4(n, k, group, device, dtype) for _ in range(copies)]
    prepared = [prepare_int4(*t, scheme=scheme, in_features=k) for t in layers]
    dense: dict[str, list] = {}  # dense (and fp8) weights per impl, made on first use
    rows: list[Row] = []
    for m in ms:
        gflop = 2 * m * n * k / 1e9
        if m > 16 and gflop > max_prefill_gflop:
            skipped.append(f"{name} M={m} ({gflop:.0f} GFLOP > --max-prefill-gflop)")
            continue
        x = torch.randn(m, k, device=device).to(dtype)
        for impl in impls:
            if impl == "reference" and device.type == "cpu" and n * k > 4096 * 4096 and m <= 16:
                skipped.append(f"{name} M={m} reference (CPU, > 4096x4096)")
                continue
            if impl == "reference" and m > 16:
                continue  # the reference's prefill is dense fp32 matmul plus the dequantize
            fn, nbytes, label = _op(impl, x, prepared, layers, dense, sweep_bytes=sweep_bytes)
            # the reference takes milliseconds per call: cache residency does not matter there
            sweep = min(copies, 2) if impl == "reference" else copies
            samples = sorted(time_calls(fn, sweep, device, budget_s=budget_s, clock=clock))
            med = statistics.median(samples)
            q = statistics.quantiles(samples, n=5) if len(samples) > 1 else [med] * 4
            rows.append(
                Row(
                    device=device.type,
                    shape=name,
                    n=n,
                    k=k,
                    m=m,
                    impl=label,
                    dtype=str(dtype).removeprefix("torch."),
                    group_size=group,
                    median_ms=med * 1e3,
                    p20_ms=q[0] * 1e3,
                    p80_ms=q[3] * 1e3,
                    weight_bytes=nbytes,
                    weight_gbps=nbytes / med / 1e9,
                    copy_gbps=copy_gbps,
                    mbu=nbytes / med / 1e9 / copy_gbps,
                    tflops=2 * m * n * k / med / 1e12,
                )  # fmt: skip
            )
            print(_format(rows[-1]), flush=True)
    return rows


def _op(
    impl: str,
    x: torch.Tensor,
    prepared: list,
    layers: list[tuple],
    dense: dict[str, list],
    *,
    sweep_bytes: int,
) -> tuple[Callable[[int], object], int, str]:
    """(call on copy c, weight bytes a call reads, label) for one implementation."""
    n, k = prepared[0].out_features, prepared[0].in_features
    if impl in FP8_IMPLS:  # fp8 layers: their own copies, kept in `dense` across M
        return fp8_op(impl, x, n, k, cache=dense, sweep_bytes=sweep_bytes)
    if impl == "int4":
        return (lambda c: prepared[c](x)), prepared[0].nbytes, f"int4 {prepared[0].backend}"
    if impl == "reference":
        return (
            lambda c: w4a16_linear_reference(x, prepared[c].weights),
            prepared[0].nbytes,
            "int4 reference",
        )
    if impl.removeprefix("dense-") not in _DTYPES:
        raise SystemExit(
            f"--impls: expected int4, reference, {', '.join(FP8_IMPLS)} or dense-<dtype>, "
            f"got {impl!r}"
        )
    ddt = _DTYPES[impl.removeprefix("dense-")]
    if impl not in dense:
        dense[impl] = [torch.randn(n, k, device=x.device, dtype=ddt) for _ in layers]
    xd, weights = x.to(ddt), dense[impl]
    return (lambda c: xd @ weights[c].T), n * k * ddt.itemsize, impl


def _format(r: Row) -> str:
    return (
        f"{r.shape:30s} M={r.m:<5d} {r.impl:16s} {r.median_ms:9.3f} ms "
        f"[{r.p20_ms:.3f}-{r.p80_ms:.3f}] {r.weight_gbps:7.1f} GB/s  MBU {r.mbu:6.1%}  "
        f"{r.tflops:7.3f} TFLOPS"
    )


def smollm2_summary(rows: list[Row]) -> list[str]:
    """Per decoded token (M=1): the sum over one layer's 7 linears x 30 layers, per impl."""
    counts = {name: c for name, _, _, c in SHAPE_SETS["smollm2"]}
    per_impl: dict[str, float] = {}
    for r in rows:
        if r.m == 1 and r.shape in counts:
            per_impl.setdefault(r.impl, 0.0)
            per_impl[r.impl] += counts[r.shape] * r.median_ms * SMOLLM2_LAYERS
    complete = {i: t for i, t in per_impl.items() if sum(r.impl == i and r.m == 1 and
                r.shape in counts for r in rows) == len(counts)}  # fmt: skip
    lines = [f"SmolLM2-135M linears per decoded token ({SMOLLM2_LAYERS} layers x 7 linears, M=1):"]
    base = complete.get("dense-bf16")
    for impl, t in sorted(complete.items(), key=lambda kv: kv[1]):
        speed = f"  {base / t:.2f}x vs dense-bf16" if base else ""
        lines.append(f"  {impl:16s} {t:8.2f} ms/token{speed}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m quantkit.evals.kernels.bench_w4a16", description=__doc__
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="smollm2,llama3-8b", help="smollm2, llama3-8b or NxK list")
    p.add_argument("--m", default=",".join(map(str, DECODE_M + PREFILL_M)), help="row counts")
    p.add_argument("--dtype", default="bf16", choices=list(_DTYPES))
    p.add_argument("--group-size", type=int, default=0, help="0: 128, or 64 where 128 fails")
    p.add_argument(
        "--impls",
        default="",
        help="int4,reference,fp8,fp8-w8a8,scaled-mm (CUDA),dense-bf16,dense-fp16,dense-fp32 "
        "(default: int4,reference,dense-bf16 [,dense-fp16 on CUDA])",
    )
    p.add_argument("--max-prefill-gflop", type=float, default=None)
    p.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    p.add_argument(
        "--sweep-mb",
        type=float,
        default=None,
        help="INT4 MB per timed sweep (layer copies), default 96 on CPU, 256 on CUDA",
    )
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of the calling thread (CPU, --threads 1 only): steadier numbers "
        "on a machine shared with other jobs",
    )
    p.add_argument("--csv", type=Path, default=None)
    return p.parse_args(argv)


def _shapes(spec: str) -> list[tuple[str, int, int, int]]:
    out: list[tuple[str, int, int, int]] = []
    for item in filter(None, spec.split(",")):
        if item in SHAPE_SETS:
            out += SHAPE_SETS[item]
            continue
        try:
            n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(
                f"--shapes: expected smollm2, llama3-8b or NxK, got {item!r}"
            ) from None
        out.append((f"{n}x{k}", n, k, 1))
    return out


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter
    if args.clock == "thread":
        if device.type != "cpu" or torch.get_num_threads() != 1:
            raise SystemExit("--clock thread: expected --device cpu --threads 1")
        clock = time.thread_time
    default_impls = "int4,reference,dense-bf16" + (",dense-fp16" if device.type == "cuda" else "")
    impls = [i for i in (args.impls or default_impls).split(",") if i]
    max_gflop = args.max_prefill_gflop
    if max_gflop is None:
        max_gflop = math.inf if device.type == "cuda" else 8.0
    ms = [int(v) for v in args.m.split(",") if v]
    sweep_mb = args.sweep_mb or (256 if device.type == "cuda" else 96)
    copy_gbps = copy_bandwidth(device, clock=clock)
    header = f"{device_name(device)} | {versions()} | quantkit {git_commit()}"
    print(f"{header} | {args.clock} clock")
    print(f"copy bandwidth (read + write): {copy_gbps:.1f} GB/s", flush=True)
    rows: list[Row] = []
    skipped: list[str] = []
    for name, n, k, _ in _shapes(args.shapes):
        group = args.group_size or (128 if k % 128 == 0 else 64)
        rows += bench_shape(
            name, n, k, ms, device=device, dtype=dtype, group=group, impls=impls,
            copy_gbps=copy_gbps, budget_s=args.budget, max_prefill_gflop=max_gflop,
            sweep_bytes=int(sweep_mb * 2**20), skipped=skipped, clock=clock,
        )  # fmt: skip
    for line in smollm2_summary(rows):
        print(line)
    if skipped:
        print(f"skipped {len(skipped)} measurements:", "; ".join(skipped))
    if args.csv is not None:
        write_csv(args.csv, rows, device_name(device))
        print(f"wrote {len(rows)} rows to {args.csv}")
    return rows


def write_csv(path: Path, rows: list[Row], name: str) -> None:
    meta = {"device_name": name, "versions": versions(), "commit": git_commit()}
    fields = list(meta) + list(asdict(rows[0]) if rows else Row.__dataclass_fields__)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow(meta | asdict(r))


if __name__ == "__main__":
    run_main(main)
