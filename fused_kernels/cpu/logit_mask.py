"""A grammar's allowed-token bitmask applied to a step's logits by one C pass
(`csrc/logit_mask.c`): out = logits where the row's bit is set, else -inf.

The grammar processor calls `mask_logits` once per decode step. Where the library cannot load
(no C compiler), `mask_logits_available()` is False and the caller keeps its numpy path, which
computes the same values.
"""

from __future__ import annotations

import numpy as np
import torch

from quantkit.fused_kernels.cpu import launch as cpu_launch

# csrc/logit_mask.c, typed by `abi`: _library(variant=None).
_library = cpu_launch.library_loader("qk_logit_mask")


def mask_logits_available() -> bool:
    """True if the C kernel builds and loads here (builds it on first call)."""
    return cpu_launch.loads(_library)


def mask_logits(
    logits: torch.Tensor, bits: np.ndarray, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A [B, V] float32 tensor: `logits` where bit v of row b of `bits` ([B, W] int32 or
    uint32, W * 32 >= V) is set, else -inf. logits: float32 [B, V] on the CPU, unit stride along
    V. Written into `out` when given (float32 [B, V] on the CPU, unit stride along V, not
    `logits` itself), else into a new tensor: a fresh 200 KB tensor a step cost ~30 us more than
    a reused one after a decode step (page faults on memory the allocator had returned)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        raise ValueError(
            f"mask_logits: expected float32 [B, V] logits on the CPU, got {logits.dtype} "
            f"{tuple(logits.shape)} on {logits.device}"
        )
    rows, vocab = logits.shape
    if bits.ndim != 2 or bits.shape[0] != rows or bits.shape[1] * 32 < vocab:
        raise ValueError(
            f"mask_logits: expected a bitmask [{rows}, >= {(vocab + 31) // 32}], got "
            f"{tuple(bits.shape)}"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    words = np.ascontiguousarray(bits).view(np.uint32)
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32)
    elif (
        out.dtype != torch.float32 or out.device.type != "cpu" or tuple(out.shape) != (rows, vocab)
        or out.stride(1) != 1 or out.data_ptr() == logits.data_ptr()
    ):  # fmt: skip
        raise ValueError(
            f"mask_logits: expected out float32 [{rows}, {vocab}] on the CPU, apart from "
            f"logits, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    status = _library().qk_mask_logits(
        logits.data_ptr(), logits.stride(0), out.data_ptr(), out.stride(0),
        words.ctypes.data, words.shape[1], rows, vocab,
    )  # fmt: skip
    cpu_launch.check_status(status, "mask_logits")
    return out
