"""The embedded default model as an INT4 checkpoint, quantized once on first use and cached.

`quantkit generate` without a MODEL runs SmolLM2-135M-Instruct as INT4, so a fresh install
needs a checkpoint nobody asked to make. It is produced exactly as `quantkit quantize
smollm2-135m` would (AWQ, group size auto, the bundled calibration text, seed 0), minus the
perplexity evaluation, and written to `$QUANTKIT_HOME/checkpoints/smollm2-135m-awq-int4`. That
takes a few minutes on a small CPU, once; later calls find the directory and return at once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from quantkit.paths import file_lock, quantkit_home
from quantkit.sources.resolve import DEFAULT_MODEL

EMBEDDED_INT4_NAME = f"{DEFAULT_MODEL}-awq-int4"


def embedded_int4_dir(*, home: Path | None = None) -> Path:
    """Where the cached INT4 checkpoint of the embedded model lives (it may not exist yet)."""
    return quantkit_home(home) / "checkpoints" / EMBEDDED_INT4_NAME


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_embedded_int4(
    *,
    home: Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
) -> Path:
    """The cached INT4 checkpoint of the embedded model, made on first use (AWQ, minutes).

    `log` receives one line before the work starts and one when it is done (stderr by default,
    so a `--json` stdout stays machine-readable).
    """
    target = embedded_int4_dir(home=home)
    if (target / "config.json").is_file():
        return target
    with file_lock(target.parent / f"{target.name}.lock"):
        if (target / "config.json").is_file():  # another process made it while we waited
            return target
        log(
            f"first use: quantizing {DEFAULT_MODEL} to INT4 with AWQ (as `quantkit quantize "
            f"{DEFAULT_MODEL}`), once; cached at {target}"
        )
        started = time.perf_counter()
        _quantize_embedded(target, home=home, progress=progress)
        log(f"quantized in {time.perf_counter() - started:.0f} s; later runs reuse {target}")
    return target


def _quantize_embedded(target: Path, *, home: Path | None, progress: bool) -> None:
    from tqdm.auto import tqdm

    from quantkit.format.checkpoint import save_checkpoint
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.awq import AwqConfig, LayerReport
    from quantkit.quantize.calibration import calibration_samples, wiki_split
    from quantkit.quantize.pipeline import DEFAULT_CALIB_SAMPLES, quantize_model
    from quantkit.sources.resolve import resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    # The `quantkit quantize` defaults: 64 x 512 calibration tokens, seed 0, group size auto.
    n_samples, seq_len, seed = DEFAULT_CALIB_SAMPLES, 512, 0
    model_dir = resolve_model(DEFAULT_MODEL, home=home, progress=progress)
    tokenizer = load_tokenizer(model_dir)

    def samples():  # type: ignore[no-untyped-def]
        docs = wiki_split(home=home).calibration
        return calibration_samples(docs, tokenizer, n_samples=n_samples, seq_len=seq_len, seed=seed)

    bar = tqdm(desc="AWQ layers", unit="layer", disable=not progress)

    def on_layer(report: LayerReport) -> None:
        bar.update(1)

    try:
        outcome = quantize_model(
            model_dir,
            scheme=QuantScheme("awq", 4, "auto", False),
            samples=samples,
            awq=AwqConfig(seed=seed),
            on_layer=on_layer,
        )
    finally:
        bar.close()
    report = {
        "model": DEFAULT_MODEL,
        "scheme": outcome.scheme.describe(),
        "calibration": {
            "source": "wikipedia (bundled articles, calibration split)",
            "samples": n_samples,
            "seq_len": seq_len,
            "seed": seed,
        },
        "timings_s": {k: round(v, 2) for k, v in outcome.timings.items()},
        "bytes_before": outcome.bytes_before,
        "bytes_after": outcome.bytes_after,
        "perplexity": None,  # skipped on first use; `quantkit quantize` measures it
        "made_by": "quantkit generate (first use of the embedded default)",
    }
    save_checkpoint(
        target,
        source_dir=model_dir,
        config=outcome.config,
        tensors=outcome.tensors,
        scheme=outcome.scheme,
        quantized_modules=outcome.quantized_modules,
        report=report,
        force=True,
    )
