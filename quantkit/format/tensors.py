"""The tensor contract of one quantized Linear, and its one validator.

A quantized Linear W [N = out, K = in] is stored exactly as compressed-tensors stores it, under
the same local names; each format declares its own names, shapes and dtypes
(`quantkit.format.int4`, `quantkit.format.fp8`), plus an optional `bias` [N].

`check_module_tensors` is the one validator of that contract; the checkpoint writer and loader
and `QuantLinear.from_tensors` all call it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.errors import CheckpointError, SchemeError
from quantkit.format.dtypes import SCALE_DTYPES
from quantkit.format.scheme import QuantScheme
from quantkit.format.weight_format import check_tensor


def check_module_tensors(
    tensors: Mapping[str, torch.Tensor], *, scheme: QuantScheme, prefix: str = ""
) -> tuple[int, int]:
    """Validate one module's tensors (local names) against `scheme`; return (N, K).

    Every problem is a CheckpointError naming the tensor ("<prefix>.<local name>") with the
    expected and the actual shape or dtype.
    """
    if not scheme.is_resolved:
        raise SchemeError("group_size is still 'auto'; call resolve() with the model first")
    name = (lambda local: f"{prefix}.{local}") if prefix else (lambda local: local)
    required = scheme.format.tensor_names(scheme)
    for local in required:
        if local not in tensors:
            raise CheckpointError(f"missing tensor {name(local)} ({scheme.describe()})")
    unexpected = sorted(set(tensors) - set(required) - {"bias"})
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {name(unexpected[0])}: a {scheme.describe()} module holds only "
            f"{', '.join(required)} (+ bias)"
        )
    n, k = scheme.format.check(tensors, scheme, name)
    if "bias" in tensors:
        check_tensor(name("bias"), tensors["bias"], (n,), SCALE_DTYPES)
    for local, t in tensors.items():
        # A NaN or infinite scale decodes to garbage without a word: damage, not a model.
        if t.dtype in SCALE_DTYPES and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(
                f"tensor {name(local)}: expected finite values, got {bad} NaN or infinite"
            )
    return n, k
