"""`quantkit roofline MODEL`: the article's planning questions for one model on one machine."""

from __future__ import annotations

import click
import torch

from quantkit.errors import SchemeError
from quantkit.format.scheme import QuantScheme
from quantkit.perf.bandwidth import cpu_bandwidth
from quantkit.perf.hardware import GPUS, local_hardware
from quantkit.perf.planning import format_plan, plan, resolve_shape


def _group_size(value: str, shape_in_features: list[int]) -> int:
    """--group-size as an int; auto = the largest of 128/64/32 dividing every layer (as the
    quantizer picks it)."""
    if value == "auto":
        group: int | str = "auto"
    else:
        try:
            group = int(value)
        except ValueError:
            raise SchemeError(
                f"--group-size: expected auto, 32, 64, 128 or -1, got {value!r}"
            ) from None
    layers = [(f"Linear with in_features {k}", k) for k in shape_in_features]
    return int(QuantScheme("int4", group).resolve(layers).group_size)  # type: ignore[arg-type]


@click.command("roofline")
@click.argument("model")
@click.option(
    "--gpu",
    default=None,
    help=f"A GPU from the table ({', '.join(GPUS)}); default: this machine.",
)
@click.option(
    "--bits",
    type=click.Choice(["4", "8", "16", "32"]),
    default="16",
    show_default=True,
    help="Width of the decoder Linears: 4 = INT4, 8 = FP8, 16/32 = dense.",
)
@click.option("--group-size", default="auto", show_default=True, help="INT4: auto|32|64|128|-1")
@click.option("--context", type=int, default=8192, show_default=True, help="Tokens per user.")
@click.option("--users", type=int, default=1, show_default=True, help="Concurrent sequences.")
@click.option("--batch", type=int, default=1, show_default=True, help="Decode batch size.")
@click.option(
    "--dense-bytes",
    type=click.Choice(["auto", "2", "4"]),
    default="auto",
    show_default=True,
    help="Bytes per dense value (embeddings, scales, KV); auto = 2 on a GPU, 4 on a CPU "
    "(quantkit runs fp32 there).",
)
@click.option(
    "--measure",
    "--remeasure",
    "remeasure",
    is_flag=True,
    help="Probe this CPU's bandwidth again now (keeps the better of the cached and new figures; "
    "run it on a quiet machine).",
)
def roofline_cmd(
    model: str,
    gpu: str | None,
    bits: str,
    group_size: str,
    context: int,
    users: int,
    batch: int,
    dense_bytes: str,
    remeasure: bool,
) -> None:
    """Plan MODEL (a model directory, a config.json, or one of the built-in shapes:
    llama-3.1-8b, llama-3.1-70b, llama-2-7b, ...) on a GPU or this machine: weight and KV
    bytes, users that fit, decode/prefill intensity vs the ridge point, ceiling tok/s."""
    name, shape = resolve_shape(model)
    if gpu is not None:
        hardware = gpu  # looked up (and validated) by plan()
        on_cpu = False
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if remeasure and device == "cpu":
            cpu_bandwidth(remeasure=True)
        hardware = local_hardware(device)
        on_cpu = device == "cpu"
    width = int(bits)
    dense = (4 if on_cpu else 2) if dense_bytes == "auto" else int(dense_bytes)
    in_features = sorted({k for _, k in shape.linear_shapes()})
    group = _group_size(group_size, in_features) if width == 4 else 128
    report = plan(
        shape,
        hardware=hardware,
        model=name,
        bits=width,
        group_size=group,
        dense_bytes=dense,
        kv_dtype_bytes=dense,
        context=context,
        users=users,
        batch=batch,
    )
    click.echo(format_plan(report))
