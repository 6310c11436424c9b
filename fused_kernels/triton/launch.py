"""What the Triton launchers (`w4a16`, `fp8`) share around their own kernels.

`is_interpreted`, `check_device` (the device, and the dtype under the interpreter),
`check_launch` (+ `path`), `rows` (x as [M, K] and the path M takes), `gemv_buffer`, `launch`
(autotuned or with a fixed `BlockConfig`, with each kind's grid) and `gemv_result`.

The kernels themselves stay in their files, each with its own grouped program order (GEMM) and
split-K range and store (GEMV): moved into shared inlined `@triton.jit` helpers they lower to
the same PTX instructions, but ptxas schedules some FP8 variants differently (sm_90), so they
would not be the same machine code. This module imports Triton only inside its functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from quantkit.errors import KernelUnavailableError
from quantkit.fused_kernels.triton.configs import GEMV_MAX_M, BlockConfig, gemv_block_m

if TYPE_CHECKING:
    import triton

PATHS = ("auto", "gemv", "gemm")


def is_interpreted(kernel: object) -> bool:
    """True if `kernel` was decorated under TRITON_INTERPRET=1 (it runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(
    device: torch.device, dtype: torch.dtype, *, interpreted: bool, module: str
) -> None:
    """Raise unless `device` (and, under the interpreter, `dtype`) runs the kernels of `module`,
    decorated under the interpreter or not."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreted:
        if dtype == torch.bfloat16:
            raise KernelUnavailableError(
                "triton interpreter: expected float16 or float32 activations (numpy has no "
                "bfloat16), got bfloat16"
            )
        return
    raise KernelUnavailableError(
        f"triton backend: expected CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
        f"before {module} is imported), got {device}"
    )


def check_launch(x: torch.Tensor, path: str, *, interpreted: bool, module: str) -> None:
    """`check_device` for x, and `path` is one the launchers take."""
    check_device(x.device, x.dtype, interpreted=interpreted, module=module)
    if path not in PATHS:
        raise ValueError(f"path: expected 'auto', 'gemv' or 'gemm', got {path!r}")


def rows(x: torch.Tensor, k: int, path: str) -> tuple[torch.Size, torch.Tensor, int, str]:
    """(x's leading dims, x as [M, K], M, the path: `path`, or for "auto" gemv when M <= 16)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    kind = path if path != "auto" else ("gemv" if m <= GEMV_MAX_M else "gemm")
    return lead, x2, m, kind


def gemv_buffer(
    m: int, n: int, device: torch.device, config: BlockConfig | None
) -> tuple[int, torch.Tensor]:
    """(BLOCK_M of the GEMV for M rows, its zeroed fp32 output: a buffer for any SPLIT_K, as
    autotune may pick one that adds partial sums)."""
    block_m = gemv_block_m(m)
    if config is not None and config.block_m != block_m:
        raise ValueError(f"config.block_m: the GEMV takes {block_m} for M={m}, got {config}")
    return block_m, torch.zeros(m, n, dtype=torch.float32, device=device)


def launch(
    kind: str,
    kernel: triton.JITFunction,
    tuned: Callable[[], triton.runtime.Autotuner],
    args: tuple,
    *,
    m: int,
    n: int,
    config: BlockConfig | None,
    **constexprs: Any,
) -> None:
    """Run the `kind` ("gemv" or "gemm") kernel on `args`: autotuned (`tuned()`, the wrapper of
    its M bucket) when `config` is None, else with `config`'s blocks. The GEMV's grid is (N
    blocks, SPLIT_K), the GEMM's one program per [BLOCK_M, BLOCK_N] output tile."""
    import triton

    if kind == "gemv":
        if config is None:
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
            tuned()[grid](*args, **constexprs)
        else:
            grid = (triton.cdiv(n, config.block_n), config.split_k)
            kernel[grid](
                *args, num_warps=config.num_warps, num_stages=config.num_stages,
                **config.meta("gemv"), **constexprs,
            )  # fmt: skip
        return
    if config is None:
        grid = lambda meta: (  # noqa: E731
            triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
        )
        tuned()[grid](*args, **constexprs)
    else:
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
        kernel[grid](
            *args, num_warps=config.num_warps, num_stages=config.num_stages,
            **config.meta("gemm"), **constexprs,
        )  # fmt: skip


def gemv_result(
    y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, lead: torch.Size
) -> torch.Tensor:
    """The GEMV's fp32 buffer y [M, N] (+ bias) in x's dtype, shaped [*lead, N]."""
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*lead, y.shape[1])
