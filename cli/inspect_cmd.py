"""`quantkit inspect CKPT`: the scheme, the report, and every tensor's shape and dtype."""

from __future__ import annotations

from pathlib import Path

import click

from quantkit.errors import ModelSourceError
from quantkit.format.checkpoint import load_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.models.config import ModelConfig


@click.command("inspect")
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.option("--all", "show_all", is_flag=True, help="List every tensor, not only layer 0.")
def inspect_cmd(ckpt: Path, show_all: bool) -> None:
    """Print a checkpoint's scheme and its tensors' shapes and dtypes."""
    loaded = load_checkpoint(ckpt)
    scheme = loaded.scheme
    click.echo(f"checkpoint   {ckpt}")
    click.echo(
        f"scheme       {scheme.describe(loaded.algorithm) if scheme else 'dense (not quantized)'}"
    )
    click.echo(f"quantized    {len(loaded.quantized_modules)} Linear modules")
    why = _pytorch_path(loaded.config, scheme)
    if why is not None:
        click.echo(f"cpu decode   PyTorch path, not the C step: {why}")
    report = loaded.report or {}
    ppl = report.get("perplexity")
    if ppl:
        click.echo(
            f"perplexity   reference {ppl['reference']:.3f} -> quantized {ppl['quantized']:.3f} "
            f"({ppl['tokens']} held-out tokens)"
        )
    total = sum(t.numel() * t.element_size() for t in loaded.tensors.values())
    click.echo(f"tensors      {len(loaded.tensors)}, {total / 1e6:.1f} MB")
    hidden = 0
    for name in sorted(loaded.tensors, key=_natural):
        if not show_all and ".layers." in name and ".layers.0." not in name:
            hidden += 1
            continue
        t = loaded.tensors[name]
        dtype = str(t.dtype).removeprefix("torch.")
        click.echo(f"  {name:<56} {dtype:<14} {list(t.shape)}")
    if hidden:
        click.echo(f"  ... {hidden} more in layers 1+ (same shapes; --all lists them)")


def _pytorch_path(config: dict, scheme: QuantScheme | None) -> str | None:
    """Why a CPU decodes this checkpoint on the PyTorch path, or None for the C step."""
    try:
        why = ModelConfig.from_dict(config).pytorch_only()
    except ModelSourceError as e:
        return str(e)
    if why is None and (scheme is None or not scheme.format.c_step):
        return "the C step runs INT4 checkpoints only"
    return why


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]
