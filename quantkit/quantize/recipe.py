"""Quantize a model and write its checkpoint: the one path `quantkit quantize` and the embedded
default's first use share.

A `Recipe` is what the user asked for (model, format, algorithm, calibration); `quantize_and_save`
tokenizes the calibration text before any model work (a bad file fails fast), runs the pipeline,
optionally scores the reference and the quantized model with a caller-supplied function (the CLI
passes held-out perplexity; this layer does not import the evals), builds the report that
quantkit.json stores, and writes the checkpoint atomically.
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import SchemeError
from quantkit.format.checkpoint import check_output_dir
from quantkit.format.scheme import QuantScheme
from quantkit.models.decoder import CausalLM, build_model
from quantkit.quantize.algorithms import ALGORITHMS, Algorithm, algorithm_for
from quantkit.quantize.awq import AwqConfig
from quantkit.quantize.calibration import calibration_samples, read_calib_file, wiki_split
from quantkit.quantize.gptq import GptqConfig
from quantkit.quantize.memory_plan import check_memory, plan_memory
from quantkit.quantize.pipeline import LayerProgress, QuantizeOutcome, load_dense
from quantkit.quantize.source_model import SourceModel, open_source
from quantkit.quantize.staging import Staging, staging_dir
from quantkit.quantize.streaming import stream_quantize
from quantkit.sources.resolve import resolve_model
from quantkit.sources.tokenizer import load_tokenizer

BUNDLED_CALIBRATION = "wikipedia (bundled articles, calibration split)"


@dataclass(frozen=True)
class Calibration:
    """Where calibration text comes from and how much of it the statistics use."""

    path: Path | None = None  # None: the bundled Wikipedia articles (calibration split)
    samples: int | None = None  # windows; None: the algorithm's default
    seq_len: int = 512
    seed: int = 0

    def check(self) -> None:
        if (self.samples is not None and self.samples < 1) or self.seq_len < 16:
            raise SchemeError(
                f"--calib-samples >= 1 and --calib-seq-len >= 16 expected, got {self.samples} "
                f"and {self.seq_len}"
            )


@dataclass(frozen=True)
class Recipe:
    model: str  # a local HF directory, a .gguf file or the embedded default's name
    scheme: QuantScheme
    algorithm: str | None = None  # None: the format's default (`algorithms.DEFAULT_ALGORITHM`)
    calibration: Calibration = field(default_factory=Calibration)
    awq: AwqConfig = field(default_factory=AwqConfig)
    gptq: GptqConfig = field(default_factory=GptqConfig)
    quantize_head: bool = False  # the lm_head too (round to nearest, same scheme)

    def method(self) -> Algorithm:
        return algorithm_for(self.algorithm, self.scheme)


@dataclass
class Hooks:
    """What the caller sees of long work: each decoder layer's report, a line of text, and an
    optional scorer (model -> perplexity) run on the reference and the quantized model."""

    on_layer: Callable[[LayerProgress], None] | None = None
    on_start: Callable[[Algorithm, int], None] | None = None  # (algorithm, layer count)
    # (model, "reference" | "quantized", the model's tokenizer) -> fields of the report
    score: Callable[[CausalLM, str, Any], dict[str, Any]] | None = None


def quantize_and_save(
    recipe: Recipe,
    out: Path,
    *,
    force: bool = False,
    home: Path | None = None,
    progress: bool = True,
    hooks: Hooks | None = None,
    extra_report: dict[str, Any] | None = None,
    restart: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[QuantizeOutcome, dict[str, Any]]:
    """Quantize `recipe.model` layer by layer (`streaming`) and write the checkpoint to `out`;
    returns the outcome and the report stored in quantkit.json.

    Finished layers wait in `<out>.partial/`: a run that is killed leaves them there, and the
    same call again continues from the first unfinished layer (`restart` starts over). On a
    GPU (`device`), each layer is calibrated there (`streaming`)."""
    started = time.perf_counter()
    device = torch.device(device)
    hooks = hooks or Hooks()
    method = recipe.method()
    cal = recipe.calibration
    cal.check()
    check_output_dir(out, force=force)  # fail before minutes of work, not after
    texts = read_calib_file(cal.path) if cal.path is not None else None
    model_dir = resolve_model(recipe.model, home=home, progress=progress)
    t0 = time.perf_counter()
    source = open_source(model_dir)  # headers only: a config that is wrong fails here
    open_s = time.perf_counter() - t0
    n_samples = cal.samples or method.calib_samples
    plan = plan_memory(
        source, calibrated=method.name if method.calibrated else None, samples=n_samples,
        seq_len=cal.seq_len, quantize_head=recipe.quantize_head, score=hooks.score is not None,
        awq=recipe.awq, gptq=recipe.gptq, scheme=recipe.scheme,
    )  # fmt: skip
    check_memory(plan)  # before anything is read: refused with both numbers, not killed later
    calib_ids = None
    # Loaded once (~2 s for SmolLM2's tokenizer.json) for calibration and the scorer alike.
    tokenizer = load_tokenizer(model_dir) if method.calibrated or hooks.score else None
    if method.calibrated:
        # Tokenize and check the calibration text before any model work: a bad file fails fast.
        docs = texts if texts is not None else wiki_split(home=home).calibration
        calib_ids = calibration_samples(
            docs, tokenizer, n_samples=n_samples, seq_len=cal.seq_len, seed=cal.seed
        )
    scores: dict[str, Any] = {}
    if hooks.score is not None:  # the whole reference model, for its perplexity
        _, reference, _ = load_dense(model_dir)
        scores.update(hooks.score(reference, "reference", tokenizer))
        del reference
    staging = Staging(staging_dir(out), _fingerprint(recipe, method, source, calib_ids, device))
    resumed = staging.open(restart=restart)
    if hooks.on_start is not None:
        hooks.on_start(method, source.num_layers)
    try:
        outcome = stream_quantize(
            source,
            staging,
            scheme=recipe.scheme,
            algorithm=method.name,
            samples=None if calib_ids is None else lambda: calib_ids,
            awq=recipe.awq,
            gptq=recipe.gptq,
            on_layer=hooks.on_layer,
            quantize_head=recipe.quantize_head,
            resumed=resumed,
            device=device,
        )
        outcome.timings = {"load_s": open_s, **outcome.timings}
        if hooks.score is not None:
            t0 = time.perf_counter()
            scores.update(hooks.score(quantized_model(outcome), "quantized", tokenizer))
            outcome.timings["eval_s"] = time.perf_counter() - t0
        calibration = None
        if method.calibrated:
            source_name = str(cal.path) if cal.path is not None else BUNDLED_CALIBRATION
            calibration = {
                "source": source_name,
                "samples": n_samples,
                "seq_len": cal.seq_len,
                "seed": cal.seed,
            }
        report = build_report(
            outcome, model=recipe.model, calibration=calibration, ppl=scores, gptq=recipe.gptq
        )
        report["peak_rss_estimate_mb"] = round(plan.peak / 2**20)
        report["peak_rss_estimate_phase"] = plan.largest
        if resumed:
            report["resumed_at_layer"] = resumed
        if device.type == "cuda":
            report["device"] = f"{device} ({torch.cuda.get_device_name(device)})"
            report["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
        report.update(extra_report or {})
        t0 = time.perf_counter()
        outcome.save(out, source_dir=model_dir, report=report, force=force)
        outcome.timings["write_s"] = time.perf_counter() - t0
    except BaseException:
        if not staging.layers:  # nothing finished: nothing worth keeping
            staging.remove()
        raise
    finally:
        staging.close()
    staging.remove()
    outcome.timings["total_s"] = time.perf_counter() - started
    return outcome, report


def _fingerprint(
    recipe: Recipe,
    method: Algorithm,
    source: SourceModel,
    calib_ids: torch.Tensor | None,
    device: torch.device,
) -> dict[str, Any]:
    """What a staging directory may only be resumed with: the same weights files and config,
    format, algorithm and settings, calibration tokens (hashed), and the kind of device (a GPU
    rounds its sums in another order than the CPU: layers from both would match neither run)."""
    files = sorted({e.file for e in source.files.entries.values()})
    sections = {part: asdict(getattr(recipe, part)) for part in method.configs}
    # One algorithm's settings flat (as before combinations existed), several by name.
    settings: dict[str, Any] = next(iter(sections.values())) if len(sections) == 1 else sections
    calibration = None
    if calib_ids is not None:
        calibration = _digest(calib_ids.contiguous().numpy().tobytes())
    # Only a GPU is named, so that a CPU run's staging directory reads as before.
    where = {} if device.type == "cpu" else {"device": device.type}
    return {
        **where,
        "model": str(source.model_dir.resolve()),
        "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "config": _digest(json.dumps(source.config, sort_keys=True).encode()),
        "scheme": recipe.scheme.to_json(),
        "method": method.name,
        "settings": settings,
        "quantize_head": recipe.quantize_head,
        "calibration": calibration,
    }


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def quantized_model(outcome: QuantizeOutcome) -> CausalLM:
    """The model to score: dense weights equal to the checkpoint's, or, for W8A8 (activations
    quantized only at run time), the real quantized modules."""
    if outcome.scheme.activations == "dynamic":
        return outcome.runtime_model()
    return build_model(outcome.config, outcome.dense_state())


def build_report(
    outcome: QuantizeOutcome,
    *,
    model: str,
    calibration: dict[str, Any] | None,
    ppl: dict[str, Any],
    gptq: GptqConfig,
) -> dict[str, Any]:
    """The `report` of quantkit.json: what was asked, what it cost, what it changed."""
    reductions = [round(r.loss_reduction, 4) for r in outcome.layer_reports]
    configs = ALGORITHMS[outcome.algorithm].configs
    # AWQ and what contains it measure the layer-output MSE; GPTQ alone the Linears' error.
    layer_mse = "awq" in configs
    report: dict[str, Any] = {
        "model": model,
        "scheme": outcome.scheme.describe(outcome.algorithm),
        "algorithm": outcome.algorithm,
        "calibration": calibration,
        "timings_s": {k: round(v, 2) for k, v in outcome.timings.items()},
        "bytes_before": outcome.bytes_before,
        "bytes_after": outcome.bytes_after,
        "awq_layer_mse_reduction": reductions if layer_mse else [],
        "perplexity": ppl or None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if "gptq" in configs:
        report["gptq"] = asdict(gptq)
    if outcome.algorithm == "gptq":
        # Per layer: 1 - GPTQ/RTN of the summed Linear-output error on the calibration inputs
        # (the combinations report their layer's output error).
        report["gptq_layer_error_reduction"] = reductions
    return report


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
