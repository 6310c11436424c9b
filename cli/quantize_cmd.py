"""`quantkit quantize MODEL`: quantize, measure perplexity before/after, write the checkpoint."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import click
import torch
from tqdm.auto import tqdm

from quantkit.cli.options import parse_device
from quantkit.errors import SchemeError
from quantkit.evals.accuracy.perplexity import perplexity
from quantkit.models.decoder import CausalLM
from quantkit.paths import KEPT
from quantkit.quantize.algorithms import (
    DEFAULT_CALIB_SAMPLES,
    GPTQ_CALIB_SAMPLES,
    Algorithm,
)
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.calibration import heldout_tokens
from quantkit.quantize.choice import choose_scheme
from quantkit.quantize.clip_search import CLIP_MODES
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.memory_plan import PERPLEXITY_BATCH, PERPLEXITY_WINDOW
from quantkit.quantize.pipeline import LayerProgress, QuantizeOutcome
from quantkit.quantize.recipe import Calibration, Hooks, Recipe, quantize_and_save
from quantkit.quantize.staging import staging_dir

# The perplexity's windows, as the memory plan sizes its logits.
_WINDOWS = {"window": PERPLEXITY_WINDOW, "batch_size": PERPLEXITY_BATCH}


@click.command("quantize")
@click.argument("model")
@click.option("--bits", type=int, default=4, show_default=True, help="4 = INT4, 8 = FP8 (E4M3).")
@click.option(
    "--method",
    type=click.Choice(["rtn", "awq", "gptq", "awq+gptq", "smoothquant", "smoothquant+gptq", "fp8"]),
    default=None,
    help="The algorithm that chooses the codes: rtn (round to nearest, no calibration), awq "
    "(int4 only), gptq (error-compensated rounding; the fp8 default), "
    "awq+gptq (int4 only, its default: AWQ's scales folded, then GPTQ rounding, --refine "
    "passes after it), "
    "smoothquant (activation outliers moved into the weights, then rtn; int8 only) or "
    "smoothquant+gptq (SmoothQuant, then GPTQ rounding; int8 only, its default). The "
    "format (--bits) is the same whichever chose the codes; fp8 = --bits 8 "
    "--method rtn.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["int4", "fp8", "int8", "nvfp4", "mxfp4"]),
    default=None,
    help="Name the format instead of --bits (fp8 = --bits 8); int8 = W8A8 (int8 weights per "
    "channel, int8 activations per token), the fastest prefill on CPUs with AVX512-VNNI; "
    "nvfp4 / mxfp4 = FP4 E2M1 weights (groups of 16 with E4M3 scales and a global scale / "
    "groups of 32 with E8M0 scales; --bits 4 stays int4).",
)
@click.option(
    "--activations",
    type=click.Choice(["none", "dynamic"]),
    default="none",
    show_default=True,
    help="FP8: dynamic = W8A8 with per-token scales (int8 is always W8A8).",
)
@click.option("--group-size", default="auto", show_default=True, help="auto|32|64|128|-1")
@click.option("--symmetric", is_flag=True, help="INT4 without zero points.")
@click.option(
    "--quantize-head/--dense-head",
    default=False,
    show_default=True,
    help="Store lm_head in the same format too (round to nearest; the embedding stays dense "
    "and is untied): fewer bytes per decode step, at a measured perplexity cost.",
)
@click.option("--calib", type=click.Path(path_type=Path), help=".txt or .jsonl ('text').")
# 64 x 512, not AWQ's 128 x 512: on SmolLM2-135M, 64 samples closed 56-57% of the RTN gap on
# every seed measured while 128 gave 13-55% (evals/studies/awq_quality.py), and it halves the time.
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
    "--clip",
    type=click.Choice(CLIP_MODES),
    default=GptqConfig.clip,
    show_default=True,
    help="GPTQ, INT4 only: shrink each group's range before rounding by the ratio minimising "
    "the weights' squared error (mse) or the group's output error on the calibration inputs "
    "(output).",
)
@click.option(
    "--refine",
    type=int,
    default=GptqConfig.refine,
    show_default=True,
    help="GPTQ, INT4 only: passes of coordinate descent after GPTQ's rounding, over the codes "
    "then the group scales, each lowering the layer's output error on the calibration inputs "
    "(awq+gptq, the INT4 default: 68.6% of the RTN perplexity gap closed on SmolLM2-135M with "
    "4 passes, 62.5% with 0; 16% more quantize time).",
)
@click.option(
    "--eval-tokens",
    type=int,
    default=8192,
    show_default=True,
    help="Held-out tokens for perplexity before/after (0 skips it).",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Where each layer is calibrated and rounded: auto (the first GPU when there is one), "
    "cpu or cuda[:N]. Only the layer being quantized and its calibration activations go to "
    "the GPU; the rest stays on disk and in host memory.",
)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Checkpoint directory.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option(
    "--restart",
    is_flag=True,
    help="Discard the finished layers an interrupted run left in OUTPUT.partial/ and start over "
    "(without it, the same command resumes from the first unfinished layer).",
)
def quantize_cmd(
    model: str,
    bits: int,
    method: str | None,
    fmt: str | None,
    activations: str,
    group_size: str,
    symmetric: bool,
    quantize_head: bool,
    calib: Path | None,
    calib_samples: int | None,
    calib_seq_len: int,
    seed: int,
    search_tokens: int,
    damp: float,
    act_order: bool,
    clip: str,
    refine: int,
    eval_tokens: int,
    device: str,
    output: Path | None,
    force: bool,
    restart: bool,
) -> None:
    """Quantize MODEL (a local HF directory, a .gguf file, or smollm2-135m) to a
    compressed-tensors checkpoint."""
    scheme, algorithm = choose_scheme(
        bits=bits, method=method, fmt=fmt, activations=activations, group_size=group_size,
        symmetric=symmetric, given=_given(click.get_current_context()),
    )  # fmt: skip
    if damp < 0:
        raise SchemeError(f"--damp: expected a fraction >= 0, got {damp}")
    if refine < 0:
        raise SchemeError(f"--refine: expected a number of passes >= 0, got {refine}")
    where = parse_device(device)
    recipe = Recipe(
        model,
        scheme,
        algorithm,
        Calibration(calib, calib_samples, calib_seq_len, seed),
        awq=AwqConfig(search_tokens=search_tokens, seed=seed),
        gptq=GptqConfig(damp=damp, act_order=act_order, clip=clip, refine=refine),
        quantize_head=quantize_head,
    )
    out = (
        output
        or Path("out") / f"{Path(model).name.removesuffix('.gguf')}-{algorithm}-{scheme.kind}"
    )
    hooks = _progress(_perplexity_scorer(eval_tokens, where))
    try:
        outcome, report = quantize_and_save(
            recipe, out, force=force, hooks=hooks, restart=restart, device=where
        )
    except BaseException:
        _say_kept(out)
        raise
    finally:
        if hooks.bar is not None:
            hooks.bar.close()
    _summary(outcome, report, out=out, group_size=group_size)


class _CliHooks(Hooks):
    bar: tqdm | None = None  # made when the layer walk starts
    method: Algorithm | None = None


def _progress(score: Any) -> _CliHooks:
    """A progress bar per decoder layer (a resumed run starts it at the layers kept)."""
    hooks = _CliHooks(score=score)

    def on_start(method: Algorithm, layers: int) -> None:
        hooks.method = method
        hooks.bar = tqdm(desc=method.name.upper(), unit="layer", total=layers)

    def on_layer(report: LayerProgress) -> None:
        assert hooks.bar is not None and hooks.method is not None
        if hooks.method.calibrated:
            # AWQ (and awq+gptq) compare the layer's output MSE, GPTQ the Linears' output error
            # (tr(dW H dW^T)).
            what = "MSE" if "awq" in hooks.method.configs else "error"
            hooks.bar.set_postfix_str(
                f"layer {report.index}: {what} vs RTN {-report.loss_reduction:+.0%}"
            )
        hooks.bar.update(1)
        if hooks.bar.n >= (hooks.bar.total or 0):
            hooks.bar.close()  # before the lines the checkpoint's writing may print

    hooks.on_start, hooks.on_layer = on_start, on_layer
    return hooks


def _perplexity_scorer(eval_tokens: int, device: torch.device) -> Any:
    """Held-out perplexity of a model, in the windows and batches the memory plan sizes
    (`memory_plan.PERPLEXITY_WINDOW`, 512 tokens; None when --eval-tokens is 0), on `device`."""
    if eval_tokens <= 0:
        return None
    held = None

    def score(dense: CausalLM, which: str, tokenizer: Any) -> dict[str, Any]:
        nonlocal held
        if held is None:  # tokenized once, on the reference, for both models
            held = heldout_tokens(tokenizer, max_tokens=eval_tokens)
        model = dense.to(device)

        def logits(ids: torch.Tensor) -> torch.Tensor:
            return model(ids.to(device))

        if which == "reference":
            click.echo(f"perplexity of the reference model on {held.numel()} held-out tokens ...")
            return {"reference": perplexity(logits, held, **_WINDOWS, progress=True).ppl}
        ppl = perplexity(logits, held, **_WINDOWS, progress=True).ppl
        return {"quantized": ppl, "tokens": held.numel(), "window": PERPLEXITY_WINDOW}

    return score


def _say_kept(out: Path) -> None:
    """After a failure or Ctrl-C: where the finished layers wait, and how to continue (said
    on the CLI's last line, `paths.KEPT`)."""
    staged = staging_dir(out)
    done = len(list(staged.glob("layer-*.safetensors"))) if staged.is_dir() else 0
    if done:
        KEPT.append(
            f"{done} finished layer(s) kept in {staged}: run the same command again to resume"
        )


def _given(ctx: click.Context) -> set[str]:
    """The parameters set on the command line (not defaults or the environment)."""
    source = click.core.ParameterSource.COMMANDLINE
    return {name for name in ctx.params if ctx.get_parameter_source(name) == source}


def _summary(
    outcome: QuantizeOutcome, report: dict[str, Any], *, out: Path, group_size: str
) -> None:
    t = outcome.timings
    scheme = outcome.scheme
    picked = ""
    if scheme.format.grouped and group_size == "auto":
        picked = f" (group size auto -> {scheme.group_size})"
    click.echo("")
    click.echo(f"quantized    {report['model']} -> {out}")
    click.echo(f"scheme       {scheme.describe(outcome.algorithm)}{picked}")
    if report["calibration"]:
        c = report["calibration"]
        click.echo(
            f"calibration  {c['source']}: {c['samples']} x {c['seq_len']} tokens, seed {c['seed']}"
        )
    if report.get("resumed_at_layer"):
        click.echo(f"resumed      at layer {report['resumed_at_layer']} (earlier layers kept)")
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
    estimate = report.get("peak_rss_estimate_mb")
    phase = report.get("peak_rss_estimate_phase")
    where = f", in the {phase} phase" if phase else ""
    planned = f" (estimated before the run: at most {estimate} MB{where})" if estimate else ""
    click.echo(f"peak RSS     {report['peak_rss_mb']:.0f} MB{planned}")
    if "device" in report:
        click.echo(f"device       {report['device']}: peak {report['peak_gpu_mb']} MB allocated")
