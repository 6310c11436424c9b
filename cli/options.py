"""The options of every command that runs a model (`generate`, `bench`, `serve`), declared once,
and the model loading they lead to.

`@runtime_options()` adds --device, --dtype, --head-dtype, --act-dtype, --kv-dtype, --threads and
--speculate to a command (and, with `serving=True`, the engine's --prefix-cache-mb and
--batch-invariant), and hands the command one `Runtime` value instead of those keyword
arguments. Its methods check each value with the same messages everywhere.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from quantkit.batching.types import check_prefix_cache_mb
from quantkit.errors import GenerationError
from quantkit.format.dtypes import DTYPES
from quantkit.models.kv_cache import KV_DTYPE_NAMES
from quantkit.runtime.head import HEAD_CHOICES
from quantkit.runtime.loader import LoadedModel, load_model
from quantkit.runtime.options import ACT_DTYPE_NAMES, RuntimeOptions
from quantkit.runtime.speculate import SpecConfig, parse_speculate


def parse_device(name: str) -> torch.device:
    """A --device value as a torch device: auto = the first GPU when there is one, else cpu; a
    GPU this machine does not have is refused here, not at the first tensor moved to it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise GenerationError(f"--device: expected auto, cpu or cuda[:N], got {name!r}")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise GenerationError(
                f"--device: expected a device this machine has ({count} GPU(s)), got {name}"
            )
    return device


@dataclass(frozen=True)
class Runtime:
    """What the runtime options said, unchecked until a method reads them."""

    device: str = "auto"
    dtype: str = "auto"
    head_dtype: str = "auto"
    act_dtype: str = "auto"
    kv_dtype: str = "auto"
    threads: int | None = None
    speculate: str = "off"
    prefix_cache_mb: float = 0.0
    batch_invariant: bool = False

    def torch_device(self) -> torch.device:
        """--device as a torch device: auto = cuda when there is one."""
        return parse_device(self.device)

    def set_threads(self) -> None:
        """Apply --threads to torch (nothing when not given)."""
        if self.threads is not None:
            if self.threads < 1:
                raise GenerationError(f"--threads: expected an integer >= 1, got {self.threads}")
            torch.set_num_threads(self.threads)

    def speculation(self) -> SpecConfig | None:
        return parse_speculate(self.speculate)

    def prefix_cache(self) -> float:
        return check_prefix_cache_mb(self.prefix_cache_mb, option="--prefix-cache-mb")

    def options(self, device: torch.device) -> RuntimeOptions:
        return RuntimeOptions.cli(
            dtype=self.dtype, device=str(device), head_dtype=self.head_dtype,
            act_dtype=self.act_dtype, kv_dtype=self.kv_dtype,
        )  # fmt: skip


def model_source(model: str | None) -> str | Path:
    """MODEL_OR_CKPT as given, or the embedded default as INT4 (quantized once on first use)."""
    if model is None:
        from quantkit.quantize.embedded import ensure_embedded_int4

        return ensure_embedded_int4()
    return model


def load(model: str | None, options: RuntimeOptions) -> LoadedModel:
    """Load MODEL_OR_CKPT, or the embedded default (`model_source`)."""
    return load_model(model_source(model), options=options)


_NAMES = tuple(Runtime.__dataclass_fields__)


def _declarations(serving: bool) -> list[Callable[[Any], Any]]:
    out = [
        click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N]."),
        click.option(
            "--dtype",
            type=click.Choice(["auto", *DTYPES]),
            default="auto",
            show_default=True,
            help="Activations and dense weights; auto = float32 on CPU, bfloat16 on CUDA.",
        ),
        click.option(
            "--head-dtype",
            type=click.Choice(["auto", *HEAD_CHOICES]),
            default="auto",
            show_default=True,
            help="dtype of the lm_head matmul, for an INT4/FP8 model on a CPU; auto = int8 on "
            "CPUs with AVX-512, where measured faster (rows rounded to int8 with a scale each, a "
            "quarter of the fp32 bytes, perplexity +0.04%; with AVX512-VNNI the activations are "
            "int8 too, +0.13%), else bfloat16 on a CPU with bf16 instructions, else the model's. "
            "int6: 6-bit codes with an fp16 scale per 32 weights, 6.5 bits a weight (AVX512-VNNI "
            "CPUs; held-out perplexity +0.40% over int8 on the embedded model, 19% fewer head "
            "bytes).",
        ),
        click.option(
            "--act-dtype",
            type=click.Choice(["auto", *ACT_DTYPE_NAMES]),
            default="auto",
            show_default=True,
            help="dtype of the activations inside the INT4 GEMVs of the CPU decode step; auto = "
            "the one measured fastest: int8 on CPUs with AVX512-VNNI (quantized per block of <= "
            "128 elements, multiplied in integers; measured faster on Intel Xeon and AMD Zen 4, "
            "perplexity +0.12%), else bfloat16 on AMD CPUs with AVX512-BF16, else float32.",
        ),
        click.option(
            "--kv-dtype",
            type=click.Choice(["auto", *KV_DTYPE_NAMES]),
            default="auto",
            show_default=True,
            help="Format of the KV cache; auto = the model's dtype. int8 / fp8 (e4m3) store "
            "codes with a scale per head and token: ~3.8x fewer cache bytes than float32 for "
            "64-wide heads.",
        ),
        click.option(
            "--threads", type=int, default=None, help="CPU threads for torch [default: torch's]."
        ),
        click.option(
            "--speculate",
            default="off",
            show_default=True,
            help="Speculative decoding: 'ngram' or 'ngram:K' drafts up to K tokens (default 4) "
            "by prompt lookup and verifies them in one model call; greedy output is unchanged, "
            "sampling keeps its distribution. Drafting switches itself off where drafts are not "
            "accepted; in serve, requests with a response_format or a repetition penalty do not "
            "draft.",
        ),
    ]
    if serving:
        out += [
            click.option(
                "--prefix-cache-mb",
                type=float,
                default=0.0,
                show_default=True,
                help="Reuse the K/V of prompt prefixes seen before (a shared system prompt), up "
                "to this many MiB; 0 = off.",
            ),
            click.option(
                "--batch-invariant",
                is_flag=True,
                help="Each request gets exactly the tokens it gets alone, whatever else is "
                "running (row-invariant decode steps, prefill chunks at multiples of 8; slower "
                "batched steps; the C step only).",
            ),
        ]
    return out


def runtime_options(*, serving: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the runtime options on a click command and pass them as `runtime: Runtime`."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            chosen = {name: kwargs.pop(name) for name in _NAMES if name in kwargs}
            return fn(runtime=Runtime(**chosen), **kwargs)

        for declare in reversed(_declarations(serving)):
            command = declare(command)
        return command

    return wrap
