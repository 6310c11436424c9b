"""`quantkit quantize MODEL`: quantize, measure perplexity before/after, write the checkpoint."""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import torch
from tqdm.auto import tqdm

from quantkit.errors import CheckpointError, SchemeError
from quantkit.evals.perplexity import perplexity
from quantkit.format.checkpoint import save_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM, build_model
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.calibration import (
    calibration_samples,
    heldout_tokens,
    read_calib_file,
    wiki_split,
)
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.pipeline import (
    DEFAULT_CALIB_SAMPLES,
    GPTQ_CALIB_SAMPLES,
    LayerProgress,
    QuantizeOutcome,
    quantize_model,
)
from quantkit.sources.resolve import resolve_model
from quantkit.sources.tokenizer import load_tokenizer


def _group_size(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise SchemeError(
            f"--group-size: expected auto, 32, 64, 128 or -1, got {value!r}"
        ) from None


@click.command("quantize")
@click.argument("model")
@click.option("--bits", type=int, default=4, show_default=True, help="4 = INT4, 8 = FP8 (E4M3).")
@click.option(
    "--method",
    type=click.Choice(["awq", "rtn", "fp8", "gptq"]),
    default=None,
    help="INT4: awq (default) or rtn; 8 bits: gptq (default: calibrated error-compensated "
    "rounding) or fp8 (round to nearest, no calibration); both write the same FP8 format.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["int4", "fp8"]),
    default=None,
    help="Name the format instead of --bits (fp8 = --bits 8).",
)
@click.option(
    "--activations",
    type=click.Choice(["none", "dynamic"]),
    default="none",
    show_default=True,
    help="FP8 only: dynamic = W8A8 with per-token scales.",
)
@click.option("--group-size", default="auto", show_default=True, help="auto|32|64|128|-1")
@click.option("--symmetric", is_flag=True, help="INT4 without zero points.")
@click.option("--calib", type=click.Path(path_type=Path), help=".txt or .jsonl ('text').")
# 64 x 512, not AWQ's 128 x 512: on SmolLM2-135M, 64 samples closed 56-57% of the RTN gap on
# every seed measured while 128 gave 13-55% (evals/awq_quality.py), and it halves the time.
# GPTQ takes 128 (quantize.GPTQ_CALIB_SAMPLES): its Hessians kept gaining.
@click.option(
    "--calib-samples",
    type=int,
    default=None,
    help=f"Calibration windows [default: {DEFAULT_CALIB_SAMPLES}, gptq {GPTQ_CALIB_SAMPLES}]",
)
@click.option("--calib-seq-len", type=int, default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Calibration draw.")
@click.option(
    "--search-tokens",
    type=int,
    default=4096,
    show_default=True,
    help="Tokens the AWQ scale search scores per layer.",
)
@click.option(
    "--damp",
    type=float,
    default=GptqConfig.damp,
    show_default=True,
    help="GPTQ only: dampening, a fraction of the mean Hessian diagonal.",
)
@click.option(
    "--act-order/--no-act-order",
    default=GptqConfig.act_order,
    show_default=True,
    help="GPTQ only: round input channels by decreasing activation energy.",
)
@click.option(
    "--eval-tokens",
    type=int,
    default=8192,
    show_default=True,
    help="Held-out tokens for perplexity before/after (0 skips it).",
)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Checkpoint directory.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
def quantize_cmd(
    model: str,
    bits: int,
    method: str | None,
    fmt: str | None,
    activations: str,
    group_size: str,
    symmetric: bool,
    calib: Path | None,
    calib_samples: int | None,
    calib_seq_len: int,
    seed: int,
    search_tokens: int,
    damp: float,
    act_order: bool,
    eval_tokens: int,
    output: Path | None,
    force: bool,
) -> None:
    """Quantize MODEL (a local HF directory, a .gguf file, or smollm2-135m) to a
    compressed-tensors checkpoint."""
    started = time.perf_counter()
    ctx = click.get_current_context()
    scheme = _scheme(
        ctx,
        bits=bits,
        method=method,
        fmt=fmt,
        activations=activations,
        group_size=group_size,
        symmetric=symmetric,
    )
    gptq = scheme.rounding == "gptq"
    method = "gptq" if gptq else scheme.method
    calibrated = scheme.method == "awq" or gptq
    if calib_samples is None:
        calib_samples = GPTQ_CALIB_SAMPLES if gptq else DEFAULT_CALIB_SAMPLES
    if damp < 0:
        raise SchemeError(f"--damp: expected a fraction >= 0, got {damp}")
    gptq_cfg = GptqConfig(damp=damp, act_order=act_order)
    if calib_samples < 1 or calib_seq_len < 16:
        raise SchemeError(
            f"--calib-samples >= 1 and --calib-seq-len >= 16 expected, got {calib_samples} "
            f"and {calib_seq_len}"
        )
    kind = "int4" if scheme.is_int else "fp8"
    out = output or Path("out") / f"{Path(model).name.removesuffix('.gguf')}-{method}-{kind}"
    # Fail before hours of work, not after.
    if out.exists() and not force:
        raise CheckpointError(f"output directory {out} exists; pass --force to replace it")
    if calib is not None:
        texts, calib_name = read_calib_file(calib), str(calib)
    else:
        texts, calib_name = None, "wikipedia (bundled articles, calibration split)"
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    held = heldout_tokens(tokenizer, max_tokens=eval_tokens) if eval_tokens > 0 else None
    ppl: dict[str, Any] = {}

    bar: tqdm | None = None

    def on_loaded(dense: CausalLM) -> None:
        nonlocal bar
        if held is not None:
            click.echo(f"perplexity of the reference model on {held.numel()} held-out tokens ...")
            ppl["reference"] = perplexity(dense, held, window=512, progress=True).ppl
        if calibrated:
            bar = tqdm(desc=method.upper(), unit="layer", total=dense.config.num_layers)

    calib_ids: torch.Tensor | None = None
    if calibrated:
        # Tokenize and check the calibration text before any model work: a bad file fails fast.
        docs = texts if texts is not None else wiki_split().calibration
        calib_ids = calibration_samples(
            docs, tokenizer, n_samples=calib_samples, seq_len=calib_seq_len, seed=seed
        )

    def on_layer(report: LayerProgress) -> None:
        assert bar is not None
        what = "error" if gptq else "MSE"
        bar.set_postfix_str(f"layer {report.index}: {what} vs RTN {-report.loss_reduction:+.0%}")
        bar.update(1)

    try:
        outcome = quantize_model(
            model_dir,
            scheme=scheme,
            samples=None if calib_ids is None else lambda: calib_ids,
            awq=AwqConfig(search_tokens=search_tokens, seed=seed),
            gptq=gptq_cfg,
            on_layer=on_layer,
            on_loaded=on_loaded,
        )
    finally:
        if bar is not None:
            bar.close()
    t0 = time.perf_counter()
    if held is not None:
        if outcome.scheme.activations == "dynamic":
            # W8A8: the activations are quantized only at run time, so run the real modules.
            quantized = outcome.runtime_model()
        else:
            quantized = build_model(outcome.config, outcome.dense_state())
        ppl["quantized"] = perplexity(quantized, held, window=512, progress=True).ppl
        ppl["tokens"] = held.numel()
        ppl["window"] = 512
        del quantized
    outcome.timings["eval_s"] = time.perf_counter() - t0
    report = _report(
        outcome,
        model=model,
        calib_name=calib_name,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        seed=seed,
        ppl=ppl,
        gptq=gptq_cfg,
    )
    t0 = time.perf_counter()
    save_checkpoint(
        out,
        source_dir=model_dir,
        config=outcome.config,
        tensors=outcome.tensors,
        scheme=outcome.scheme,
        quantized_modules=outcome.quantized_modules,
        report=report,
        force=force,
    )
    outcome.timings["write_s"] = time.perf_counter() - t0
    outcome.timings["total_s"] = time.perf_counter() - started
    _summary(outcome, report, out=out, group_size=group_size)


INT4_ONLY = ("group_size", "symmetric", "calib", "calib_samples", "calib_seq_len", "search_tokens")
CALIBRATION = ("calib", "calib_samples", "calib_seq_len")
GPTQ_ONLY = ("damp", "act_order")


def _given(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The options among `names` set on the command line, as --their-names."""
    source = click.core.ParameterSource.COMMANDLINE
    return [
        "--" + name.replace("_", "-") for name in names if ctx.get_parameter_source(name) == source
    ]


def _scheme(
    ctx: click.Context,
    *,
    bits: int,
    method: str | None,
    fmt: str | None,
    activations: str,
    group_size: str,
    symmetric: bool,
) -> QuantScheme:
    """Turn the options into a QuantScheme; options that do not apply are errors, not ignored."""
    if fmt is not None:
        implied = 8 if fmt == "fp8" else 4
        if ctx.get_parameter_source("bits") == click.core.ParameterSource.COMMANDLINE and (
            bits != implied
        ):
            raise SchemeError(f"--format {fmt} means --bits {implied}, got --bits {bits}")
        bits = implied
    if method == "gptq" and bits != 8:
        raise SchemeError(
            f"--method gptq: GPTQ rounding is implemented for fp8 only; expected --bits 8, "
            f"got --bits {bits}"
        )
    # 8 bits default to GPTQ rounding, as 4 bits default to AWQ: plain rounding costs +1.3%
    # perplexity on SmolLM2-135M, GPTQ +0.45% (README). --method fp8 rounds without calibration.
    gptq = bits == 8 and method in (None, "gptq")
    if not gptq and (given := _given(ctx, GPTQ_ONLY)):
        raise SchemeError(
            f"{', '.join(given)}: GPTQ-only option(s), expected --bits 8 without --method fp8"
        )
    if gptq:
        if given := _given(ctx, tuple(n for n in INT4_ONLY if n not in CALIBRATION)):
            raise SchemeError(
                f"{', '.join(given)}: INT4-only option(s), not valid with --bits 8 (fp8 uses "
                f"one scale per output channel)"
            )
        return QuantScheme("fp8", 8, activations=activations, rounding="gptq")  # type: ignore[arg-type]
    if bits == 8 and method == "fp8":
        if given := _given(ctx, INT4_ONLY):
            raise SchemeError(
                f"{', '.join(given)}: INT4-only option(s), not valid with --bits 8 --method fp8 "
                f"(one scale per output channel and no calibration; GPTQ, the 8-bit default, "
                f"calibrates)"
            )
        return QuantScheme("fp8", 8, activations=activations)  # type: ignore[arg-type]
    if activations != "none":
        raise SchemeError(f"--activations {activations}: only fp8 (--bits 8) quantizes activations")
    return QuantScheme(method or "awq", bits, _group_size(group_size), symmetric)  # type: ignore[arg-type]


def _report(outcome: QuantizeOutcome, **info: Any) -> dict[str, Any]:
    reductions = [round(r.loss_reduction, 4) for r in outcome.layer_reports]
    gptq = outcome.scheme.rounding == "gptq"
    calibration = None
    if outcome.scheme.method == "awq" or gptq:
        calibration = {
            "source": info["calib_name"],
            "samples": info["calib_samples"],
            "seq_len": info["calib_seq_len"],
            "seed": info["seed"],
        }
    report = {
        "model": info["model"],
        "scheme": outcome.scheme.describe(),
        "calibration": calibration,
        "timings_s": {k: round(v, 2) for k, v in outcome.timings.items()},
        "bytes_before": outcome.bytes_before,
        "bytes_after": outcome.bytes_after,
        "awq_layer_mse_reduction": [] if gptq else reductions,
        "perplexity": info["ppl"] or None,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    if gptq:
        report["gptq"] = asdict(info["gptq"])
        # Per layer: 1 - GPTQ/RTN of the summed Linear-output error on the calibration inputs.
        report["gptq_layer_error_reduction"] = reductions
    return report


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _summary(
    outcome: QuantizeOutcome, report: dict[str, Any], *, out: Path, group_size: str
) -> None:
    t = outcome.timings
    scheme = outcome.scheme
    picked = ""
    if scheme.is_int and group_size == "auto":
        picked = f" (group size auto -> {scheme.group_size})"
    click.echo("")
    click.echo(f"quantized    {report['model']} -> {out}")
    click.echo(f"scheme       {scheme.describe()}{picked}")
    if report["calibration"]:
        c = report["calibration"]
        click.echo(
            f"calibration  {c['source']}: {c['samples']} x {c['seq_len']} tokens, seed {c['seed']}"
        )
    phases = "  ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in t.items())
    click.echo(f"time         {phases}")
    before, after = outcome.bytes_before, outcome.bytes_after
    ratio = before / after
    click.echo(f"size         {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({ratio:.2f}x smaller)")
    red = report["awq_layer_mse_reduction"]
    if red:
        # Signed change of the layer-output MSE relative to RTN: negative = AWQ is closer to fp.
        change = sorted(-r for r in red)
        click.echo(
            f"AWQ          layer-output MSE vs RTN: median {statistics.median(change):+.0%} "
            f"(best {change[0]:+.0%}, worst {change[-1]:+.0%}) over {len(red)} layers"
        )
    red = report.get("gptq_layer_error_reduction")
    if red:
        change = sorted(-r for r in red)
        click.echo(
            f"GPTQ         Linear-output error vs RTN: median {statistics.median(change):+.0%} "
            f"(best {change[0]:+.0%}, worst {change[-1]:+.0%}) over {len(red)} layers"
        )
    ppl = report["perplexity"]
    if ppl:
        change = ppl["quantized"] / ppl["reference"] - 1
        click.echo(
            f"perplexity   {ppl['reference']:.3f} -> {ppl['quantized']:.3f} ({change:+.1%}) "
            f"on {ppl['tokens']} held-out tokens, window {ppl['window']}"
        )
    click.echo(f"peak RSS     {report['peak_rss_mb']:.0f} MB")
