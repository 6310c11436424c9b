"""What `quantkit quantize`'s options mean: --bits / --format / --method / --activations /
--group-size / --symmetric turned into one `QuantScheme` and an algorithm name, with every
option that does not apply to that choice an error instead of being ignored.

The format's own attributes decide (`WeightFormat.grouped`, `.dynamic_activations`, `.bits`), so
a new format needs no branch here.
"""

from __future__ import annotations

from collections.abc import Collection

from quantkit.errors import SchemeError
from quantkit.format.formats import FORMATS, format_for, format_for_bits
from quantkit.format.scheme import QuantScheme
from quantkit.quantize.algorithms import ALGORITHMS, algorithm_for

# Option names (as the CLI spells its parameters) that only some choices take.
GROUPED_ONLY = ("group_size", "symmetric")
CALIBRATION = ("calib", "calib_samples", "calib_seq_len")
AWQ_ONLY = ("search_tokens",)
GPTQ_ONLY = ("damp", "act_order", "clip", "refine")


def _flags(given: Collection[str], names: tuple[str, ...]) -> list[str]:
    """The options among `names` that the user gave, as --their-names, in `names`' order."""
    return ["--" + name.replace("_", "-") for name in names if name in given]


def parse_group_size(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise SchemeError(
            f"--group-size: expected auto, 32, 64, 128 or -1, got {value!r}"
        ) from None


def choose_scheme(
    *,
    bits: int,
    method: str | None,
    fmt: str | None,
    activations: str,
    group_size: str,
    symmetric: bool,
    given: Collection[str] = (),
) -> tuple[QuantScheme, str]:
    """The format and the algorithm the options name. `given`: the options the user set
    explicitly (parameter names), which must all apply to what was chosen."""
    if fmt is not None:
        weight_format = format_for(fmt)  # int8 and fp8 are both 8 bits: the name decides
        implied = weight_format.bits
        if "bits" in given and bits != implied:
            raise SchemeError(f"--format {fmt} means --bits {implied}, got --bits {bits}")
        bits = implied
    else:
        weight_format = format_for_bits(bits)
    named = f"--format {fmt}" if fmt is not None else f"--bits {bits}"
    if method == "fp8":  # the name before format and algorithm were apart: fp8 + rtn
        if weight_format.kind != "fp8":
            raise SchemeError(f"--method fp8 means --bits 8 --method rtn, got {named}")
        method = "rtn"
    if activations != "none" and not weight_format.dynamic_activations:
        able = [
            f"{f.kind} ({f'--bits {f.bits}' if f.named_by_bits else f'--format {f.kind}'})"
            for f in FORMATS.values()
            if f.dynamic_activations
        ]
        raise SchemeError(
            f"--activations {activations}: only {' or '.join(able)} quantizes activations"
        )
    if weight_format.grouped:
        scheme = QuantScheme(weight_format.kind, parse_group_size(group_size), symmetric)  # type: ignore[arg-type]
    else:
        if wrong := _flags(given, GROUPED_ONLY):
            raise SchemeError(
                f"{', '.join(wrong)}: INT4-only option(s), not valid with {named} "
                f"({weight_format.kind} uses one scale per output channel)"
            )
        scheme = QuantScheme(weight_format.kind, activations=activations)  # type: ignore[arg-type]
    if "activations" in given and scheme.activations != activations:  # a format that fixes it
        raise SchemeError(
            f"--activations {activations}: {named} means --activations {scheme.activations} "
            f"({scheme.describe()})"
        )
    # 8 bits default to GPTQ, as 4 bits default to AWQ: plain rounding costs +1.3% perplexity on
    # SmolLM2-135M FP8, GPTQ +0.45% (README).
    algorithm = algorithm_for(method, scheme)
    for part, names in (("gptq", GPTQ_ONLY), ("awq", AWQ_ONLY)):
        if part not in algorithm.configs and (wrong := _flags(given, names)):
            able = " or ".join(a.name for a in ALGORITHMS.values() if part in a.configs)
            raise SchemeError(
                f"{', '.join(wrong)}: {part.upper()}-only option(s), expected --method {able}"
            )
    for name in ("clip", "refine"):
        if name in given and scheme.kind != "int4":
            raise SchemeError(f"--{name}: INT4-only option, not valid with {scheme.describe()}")
    if not algorithm.calibrated and (wrong := _flags(given, CALIBRATION)):
        raise SchemeError(
            f"{', '.join(wrong)}: calibration option(s), but --method {algorithm.name} "
            f"uses no calibration"
        )
    return scheme, algorithm.name
