"""The one table of dtype names: what `--dtype`, `--head-dtype`, `--act-dtype`, config.json's
`torch_dtype` and lm-eval's `dtype=` may say, and the torch dtype each name means."""

from __future__ import annotations

import torch

from quantkit.errors import SchemeError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# The dtypes a quantized Linear's scales (and biases) may be stored in.
SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)


def dtype_named(name: str, *, allowed: tuple[str, ...] = tuple(DTYPES), what: str = "dtype"):
    """The torch dtype `name` means; anything else is a SchemeError listing `allowed`."""
    if name not in allowed:
        raise SchemeError(f"{what}: expected one of {', '.join(allowed)}, got {name!r}")
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the inverse of the table, for any torch dtype."""
    return str(dtype).removeprefix("torch.")
