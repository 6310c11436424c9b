"""The serving benchmark behind `quantkit bench`: one synthetic workload replayed through the
continuous-batching engine (`quantkit.batching.engine`) at several batch caps and arrival rates,
static batching beside it, and a long-prompt workload with and without chunked prefill.

Settings, in the order they run:

1. for each rate, for each batch cap, for each mode (static, continuous): the base workload.
   Static batching at cap 1 is the same schedule as continuous at cap 1 (one request at a
   time), so it is not run twice.
2. at the largest cap and `chunk_rate` (default: the last rate): the base workload with
   `long_prompt_frac` of its prompts made `long_prompt_len` tokens long, without and with
   chunked prefill of `chunk` tokens per step.

Every setting of one workload replays the same requests (same seed). Each record holds the
metrics of `quantkit.batching.metrics` plus the raw TTFT and TPOT samples that the plots draw. A
short warm-up run comes first, so no setting pays for first-call initialization.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from quantkit.batching.engine import EngineConfig, RunResult, run_engine
from quantkit.batching.metrics import SLO, StepCost, decode_points, summarize
from quantkit.batching.workload import LengthDist, WorkloadSpec, make_workload
from quantkit.errors import GenerationError, HardwareError
from quantkit.evals.common import git_commit
from quantkit.models.decoder import CausalLM
from quantkit.perf.hardware import local_hardware
from quantkit.runtime.speculate import SpecConfig

__all__ = [
    "BenchConfig",
    "Setting",
    "format_summary",
    "format_table",
    "measure_matmul_flops",
    "plan_settings",
    "run_bench",
]


@dataclass(frozen=True)
class BenchConfig:
    """What `quantkit bench` runs; defaults keep the embedded INT4 model to a few minutes on a
    2-core CPU. chunk None (or long_prompt_frac 0) skips the chunked-prefill comparison."""

    batch_caps: tuple[int, ...] = (1, 4, 8)
    rates: tuple[float, ...] = (4.0, math.inf)
    modes: tuple[str, ...] = ("static", "continuous")
    requests: int = 24
    # Short prompts, longer outputs: the decode-bound regime batching is about. Prefill work is
    # the same at every cap, and on a CPU it is compute-bound (SmolLM2-135M INT4, one Zen 3
    # thread: ~250 prompt tok/s vs ~35 decode tok/s at batch 1), so long prompts hide the gain.
    prompt_len: LengthDist = LengthDist("uniform", 16, 64)
    output_len: LengthDist = LengthDist("uniform", 32, 64)
    chunk: int | None = 64
    long_prompt_frac: float = 0.25
    long_prompt_len: int = 512
    chunk_rate: float | None = None
    admission_limit: int | None = None
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=2.0, tpot_s=0.2))
    seed: int = 0
    shared_prefix: int = 0  # tokens every prompt starts with (`WorkloadSpec.shared_prefix_len`)
    speculate: SpecConfig | None = None  # every setting's engine (`EngineConfig.speculate`)
    prefix_cache_mb: float = 0.0  # every setting's engine (`EngineConfig.prefix_cache_mb`)
    batch_invariant: bool = False  # every setting's engine (`EngineConfig.batch_invariant`)

    def __post_init__(self) -> None:
        if not self.batch_caps or not all(isinstance(c, int) and c >= 1 for c in self.batch_caps):
            raise GenerationError(
                f"batch caps: expected integers >= 1, got {list(self.batch_caps)}"
            )
        if not self.rates or not all(r > 0 for r in self.rates):
            raise GenerationError(
                f"rates: expected positive requests/s (or inf), got {list(self.rates)}"
            )
        bad = [m for m in self.modes if m not in ("static", "continuous")]
        if not self.modes or bad:
            raise GenerationError(
                f"modes: expected static and/or continuous, got {', '.join(self.modes) or 'none'}"
            )
        if self.chunk is not None and self.chunk < 1:
            raise GenerationError(f"chunk: expected >= 1 tokens or none, got {self.chunk}")
        if self.chunk_rate is not None and not self.chunk_rate > 0:
            raise GenerationError(
                f"chunk rate: expected positive requests/s (or inf), got {self.chunk_rate}"
            )

    def workload(self, rate: float, *, long: bool) -> WorkloadSpec:
        return WorkloadSpec(
            requests=self.requests,
            rate=rate,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            long_prompt_frac=self.long_prompt_frac if long else 0.0,
            long_prompt_len=self.long_prompt_len if long else 0,
            seed=self.seed,
            shared_prefix_len=self.shared_prefix,
        )


@dataclass(frozen=True)
class Setting:
    mode: str
    batch_cap: int
    rate: float
    chunk: int | None
    long_prompts: bool

    def describe(self) -> str:
        chunk = f", chunk {self.chunk}" if self.chunk else ""
        load = ", long prompts" if self.long_prompts else ""
        return f"{self.mode} cap {self.batch_cap} rate {_rate(self.rate)}{chunk}{load}"


def plan_settings(config: BenchConfig) -> list[Setting]:
    settings = []
    for rate in config.rates:
        for cap in config.batch_caps:
            for mode in config.modes:
                if mode == "static" and cap == 1 and "continuous" in config.modes:
                    continue  # the same schedule as continuous at cap 1
                settings.append(Setting(mode, cap, rate, None, False))
    if config.chunk is not None and config.long_prompt_frac > 0:
        rate = config.chunk_rate if config.chunk_rate is not None else config.rates[-1]
        cap = max(config.batch_caps)
        for chunk in (None, config.chunk):
            settings.append(Setting("continuous", cap, rate, chunk, True))
    return settings


def _rate(rate: float | str) -> str:
    """A rate as printed: `inf` or the number without trailing zeros (records hold "inf")."""
    if isinstance(rate, str) or math.isinf(rate):
        return "inf"
    return f"{rate:g}"


# --------------------------------------------------------------------------- the machine


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, *, n: int = 1024, seconds: float = 0.3
) -> float:
    """The fastest FLOP/s of repeated n x n matmuls in `dtype`: the compute roof of a device
    without a datasheet figure (a CPU). Like the copy bandwidth, interference only lowers it, so
    the best repetition is kept."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # first call: thread pools, kernel selection
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, reps = math.inf, 0
    deadline = time.perf_counter() + seconds
    while reps < 3 or time.perf_counter() < deadline:
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
        reps += 1
    return 2 * n**3 / best


def _machine(model: CausalLM) -> dict[str, Any]:
    """Peak bandwidth and FLOP/s of the model's device, and where each number came from. The
    compute roof is that of the dtype the matmuls multiply in: the model's, or bf16 where the
    C decode step rounds the GEMVs' activations to bf16
    (`quantkit.runtime.fast_path.set_act_dtype`)."""
    device, dtype = model.device, model.dtype
    path = model.decode_path
    if path is not None and path.act_dtype == torch.bfloat16:  # set_act_dtype checked the model
        dtype = torch.bfloat16
    info: dict[str, Any] = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    try:
        hardware = local_hardware(device)
    except HardwareError as e:  # a GPU missing from the table: no roofline, still a bench
        info.update(name=str(device), bandwidth=None, bandwidth_source=str(e))
        hardware = None
    if hardware is not None:
        info.update(
            name=hardware.name, bandwidth=hardware.bandwidth, bandwidth_source=hardware.source
        )
        if hardware.measurement is not None:  # a CPU: when and how its bandwidth was probed
            info.update(bandwidth_measurement=hardware.measurement.to_json())
    if hardware is not None and hardware.bf16_flops and dtype != torch.float32:
        info.update(peak_flop_s=hardware.bf16_flops, flops_source="datasheet, dense bf16")
    else:
        kind = str(dtype).removeprefix("torch.")
        info.update(
            peak_flop_s=measure_matmul_flops(device, dtype),
            flops_source=f"measured {kind} 1024x1024 matmul (fastest repetition)",
        )
    if device.type == "cpu":
        info["threads"] = torch.get_num_threads()
    return info


# --------------------------------------------------------------------------- running


def _record(setting: Setting, run: RunResult, config: BenchConfig, **metrics_kw: Any) -> dict:
    metrics = summarize(run, slo=config.slo, **metrics_kw).to_dict()
    done = [r for r in run.requests if r.token_times_s]
    return {
        "mode": setting.mode,
        "batch_cap": setting.batch_cap,
        "rate": _rate(setting.rate) if math.isinf(setting.rate) else setting.rate,
        "chunked_prefill": setting.chunk is not None,
        "chunk": setting.chunk,
        "long_prompts": setting.long_prompts,
        "workload": config.workload(setting.rate, long=setting.long_prompts).describe(),
        **metrics,
        "speculation": run.speculation,
        "prefix_cache": run.prefix_cache,
        "samples": {
            "ttft_ms": [round(1e3 * r.ttft_s, 3) for r in done],
            "tpot_ms": [round(1e3 * g, 3) for r in done for g in r.gaps_s],
        },
    }


def run_bench(
    model: CausalLM,
    config: BenchConfig,
    *,
    source_tokens: Sequence[int] | None = None,
    on_record: Callable[[Setting, dict[str, Any]], None] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every setting of `config` on `model`; return the report (what `--json` writes):
    `records` (one per setting), `roofline` (the machine's peaks and the measured decode steps
    per batch size, from the continuous runs of the base workload) and `meta`."""
    cfg = model.config
    context = cfg.max_position_embeddings
    machine = _machine(model)
    cost = StepCost.from_model(model)
    cached: dict[tuple[float, bool], list] = {}

    def requests_for(rate: float, long: bool) -> list:
        if (rate, long) not in cached:
            spec = config.workload(rate, long=long)
            cached[(rate, long)] = make_workload(
                spec, vocab_size=cfg.vocab_size, max_total=context, source_tokens=source_tokens
            )
        return cached[(rate, long)]

    # Warm-up: the first forwards of each shape pay for allocation and kernel selection.
    warm = requests_for(config.rates[0], False)[:2]
    warm = [replace(r, arrival_s=0.0, max_new_tokens=min(r.max_new_tokens, 4)) for r in warm]
    run_engine(model, warm, EngineConfig(batch_cap=2, chunk=config.chunk))

    records, roof_steps = [], []
    for setting in plan_settings(config):
        engine = EngineConfig(
            batch_cap=setting.batch_cap,
            mode=setting.mode,  # type: ignore[arg-type]
            chunk=setting.chunk,
            admission_limit=config.admission_limit,
            speculate=config.speculate if setting.mode == "continuous" else None,
            prefix_cache_mb=config.prefix_cache_mb,
            batch_invariant=config.batch_invariant,
        )
        run = run_engine(model, requests_for(setting.rate, setting.long_prompts), engine)
        record = _record(setting, run, config, cost=cost, bandwidth=machine.get("bandwidth"))
        records.append(record)
        if setting.mode == "continuous" and not setting.long_prompts:
            roof_steps.extend(s for s in run.decode_steps if not s.prefill_tokens)
        if on_record is not None:
            on_record(setting, record)
    return {
        "records": records,
        "roofline": {**machine, "points": decode_points(roof_steps, cost)},
        "slo": {"ttft_s": config.slo.ttft_s, "tpot_s": config.slo.tpot_s},
        "meta": {
            **(meta or {}),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "commit": git_commit(),
            "weight_bytes_per_step": cost.weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token,
            "flops_per_token": cost.flops_per_token,
        },
    }


# --------------------------------------------------------------------------- report


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(records: list[dict[str, Any]]) -> str:
    header = (
        f"{'mode':<11} {'cap':>3} {'rate':>5} {'chunk':>5} {'done':>5} {'tok/s':>7} "
        f"{'req/s':>6} {'TTFT ms p50/p95/p99':>20} {'TPOT ms p50/p95/p99':>20} "
        f"{'goodput':>7} {'batch':>5} {'MBU':>5}"
    )
    lines = [header, "-" * len(header)]
    for r in records:
        ttft = "/".join(_num(r[f"ttft_ms_p{q}"], ".0f") for q in (50, 95, 99))
        tpot = "/".join(_num(r[f"tpot_ms_p{q}"], ".1f") for q in (50, 95, 99))
        chunk = str(r["chunk"]) if r["chunk"] else ("off" if r["long_prompts"] else "-")
        mode = r["mode"] + ("*" if r["long_prompts"] else "")
        lines.append(
            f"{mode:<11} {r['batch_cap']:>3} {_rate(r['rate']):>5} {chunk:>5} "
            f"{r['completed']:>2}/{r['requests']:<2} {_num(r['throughput_tok_s'], '.1f'):>7} "
            f"{_num(r['throughput_req_s'], '.2f'):>6} {ttft:>20} {tpot:>20} "
            f"{_num(r['goodput_req_s'], '.2f'):>7} {_num(r['mean_batch'], '.1f'):>5} "
            f"{_num(r['mbu'], '.0%'):>5}"
        )
    if any(r["long_prompts"] for r in records):
        lines.append("* long-prompt workload (the chunked-prefill comparison)")
    return "\n".join(lines)


def _find(records: list[dict], **want: Any) -> dict | None:
    return next((r for r in records if all(r[k] == v for k, v in want.items())), None)


def format_summary(records: list[dict[str, Any]]) -> list[str]:
    """The article's trade in three lines: batching's throughput gain, continuous vs static,
    chunked prefill's effect on the tail TPOT of running requests."""
    lines = []
    base = [r for r in records if not r["long_prompts"]]
    for rate in dict.fromkeys(r["rate"] for r in base):
        cont = sorted(
            (r for r in base if r["mode"] == "continuous" and r["rate"] == rate),
            key=lambda r: r["batch_cap"],
        )
        if len(cont) >= 2 and cont[0]["throughput_tok_s"]:
            lo, hi = cont[0], cont[-1]
            gain = hi["throughput_tok_s"] / lo["throughput_tok_s"]
            lines.append(
                f"rate {_rate(rate)}: continuous cap {hi['batch_cap']} "
                f"{hi['throughput_tok_s']:.1f} tok/s = {gain:.2f}x cap {lo['batch_cap']} "
                f"({lo['throughput_tok_s']:.1f})"
            )
        for r in cont:
            static = _find(base, mode="static", rate=rate, batch_cap=r["batch_cap"])
            if static and static["throughput_tok_s"]:
                lines.append(
                    f"rate {_rate(rate)} cap {r['batch_cap']}: continuous "
                    f"{r['throughput_tok_s']:.1f} vs static {static['throughput_tok_s']:.1f} tok/s "
                    f"({r['throughput_tok_s'] / static['throughput_tok_s']:.2f}x)"
                )
    off = _find(records, long_prompts=True, chunked_prefill=False)
    on = _find(records, long_prompts=True, chunked_prefill=True)
    if off and on:
        lines.append(
            f"chunked prefill ({on['chunk']} tokens/step, cap {on['batch_cap']}, rate "
            f"{_rate(on['rate'])}): TPOT p99 {_num(off['tpot_ms_p99'], '.1f')} -> "
            f"{_num(on['tpot_ms_p99'], '.1f')} ms, TTFT p99 {_num(off['ttft_ms_p99'], '.0f')} "
            f"-> {_num(on['ttft_ms_p99'], '.0f')} ms, {_num(off['throughput_tok_s'], '.1f')} "
            f"-> {_num(on['throughput_tok_s'], '.1f')} tok/s"
        )
    return lines
