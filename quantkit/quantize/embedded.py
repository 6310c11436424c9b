"""The embedded default model as an INT4 checkpoint, quantized once on first use and cached.

`quantkit generate` without a MODEL runs SmolLM2-135M-Instruct as INT4, so a fresh install
needs a checkpoint nobody asked to make. It is produced exactly as `quantkit quantize
smollm2-135m` would (the INT4 default: AWQ then GPTQ with 4 refine passes, group size auto,
the bundled calibration text, seed 0), minus the perplexity evaluation, and written to
`$QUANTKIT_HOME/checkpoints/smollm2-135m-awq+gptq-int4`. That takes about 11 minutes on 2 CPU
cores, once; later calls find the directory and return at once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from quantkit.cache_manifest import is_whole, whole_or_warned, write_manifest
from quantkit.paths import file_lock, quantkit_home
from quantkit.sources.resolve import DEFAULT_MODEL

EMBEDDED_INT4_NAME = f"{DEFAULT_MODEL}-awq+gptq-int4"


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
    if (target / "config.json").is_file() and is_whole(target):
        return target
    with file_lock(target.parent / f"{target.name}.lock"):
        if not (target / "config.json").is_file():
            log(
                f"first use: quantizing {DEFAULT_MODEL} to INT4 with AWQ and GPTQ (as "
                f"`quantkit quantize {DEFAULT_MODEL}`), once; cached at {target}"
            )
        elif whole_or_warned(target, what="checkpoint cache", redo="quantizing again"):
            return target  # made, perhaps by another process meanwhile
        started = time.perf_counter()
        _quantize_embedded(target, home=home, progress=progress)
        write_manifest(target)
        log(f"quantized in {time.perf_counter() - started:.0f} s; later runs reuse {target}")
    return target


def _quantize_embedded(target: Path, *, home: Path | None, progress: bool) -> None:
    """`quantkit quantize smollm2-135m --bits 4 --eval-tokens 0 -o target --force`, through the
    same function the CLI calls (perplexity is skipped on first use)."""
    from tqdm.auto import tqdm

    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.algorithms import DEFAULT_ALGORITHM
    from quantkit.quantize.recipe import Hooks, Recipe, quantize_and_save

    bar = tqdm(desc="AWQ+GPTQ layers", unit="layer", disable=not progress)
    try:
        quantize_and_save(
            Recipe(DEFAULT_MODEL, QuantScheme("int4"), DEFAULT_ALGORITHM["int4"]),
            target,
            force=True,
            home=home,
            progress=progress,
            hooks=Hooks(on_layer=lambda _report: bar.update(1)),
            extra_report={"made_by": "quantkit generate (first use of the embedded default)"},
        )
    finally:
        bar.close()
