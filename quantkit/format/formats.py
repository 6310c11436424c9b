"""The stored weight formats quantkit reads and writes: one line each.

A new format is one module with a `WeightFormat` subclass (see `quantkit.format.weight_format`)
and one entry here; `QuantScheme(kind=...)`, compressed-tensors configs, the checkpoint's tensor
contract, `QuantLinear` and round-to-nearest quantization all find it through this table.
"""

from __future__ import annotations

from quantkit.errors import SchemeError
from quantkit.format.fp8 import FP8
from quantkit.format.int4 import INT4
from quantkit.format.int8 import INT8
from quantkit.format.mxfp4 import MXFP4
from quantkit.format.nvfp4 import NVFP4
from quantkit.format.weight_format import WeightFormat

FORMATS: dict[str, WeightFormat] = {f.kind: f for f in (INT4, FP8, INT8, NVFP4, MXFP4)}


def format_for(kind: str) -> WeightFormat:
    """The format a `QuantScheme.kind` names; anything else is a SchemeError listing them."""
    fmt = FORMATS.get(kind)
    if fmt is None:
        raise SchemeError(f"kind: expected one of {', '.join(FORMATS)}, got {kind!r}")
    return fmt


def format_for_bits(bits: int) -> WeightFormat:
    """The format `--bits` names; anything else is a SchemeError listing the choices."""
    named = [f for f in FORMATS.values() if f.named_by_bits]
    for fmt in named:
        if fmt.bits == bits:
            return fmt
    choices = " or ".join(f"{f.bits} ({f.kind})" for f in named)
    raise SchemeError(f"--bits: expected {choices}, got {bits}")
