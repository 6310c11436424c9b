"""`quantkit export gguf CHECKPOINT -o model.gguf`: a checkpoint as a file other engines load."""

from __future__ import annotations

from pathlib import Path

import click

from quantkit.errors import ExportError
from quantkit.export.gguf import DENSE_TYPES, INT4_TYPES, export_gguf
from quantkit.sources.resolve import resolve_model


@click.group("export")
def export_cmd() -> None:
    """Write a checkpoint in another engine's format."""


@export_cmd.command("gguf")
@click.argument("checkpoint")
@click.option(
    "-o",
    "--output",
    "out",
    type=click.Path(path_type=Path),
    required=True,
    help="The .gguf file to write.",
)
@click.option(
    "--type",
    "qtype",
    default="auto",
    show_default=True,
    help=f"Linears: {', '.join(INT4_TYPES)} for an INT4 checkpoint (auto: q4_0 if symmetric, "
    f"else q4_1; its own codes, not rounded again), {', '.join(DENSE_TYPES[1:])} for a dense one.",
)
@click.option(
    "--dense-type",
    type=click.Choice(DENSE_TYPES),
    default="auto",
    show_default=True,
    help="Embeddings and other dense matrices (auto: as stored).",
)
@click.option(
    "--pre-tokenizer",
    default=None,
    help="llama.cpp's pre-tokenizer name (tokenizer.ggml.pre), when tokenizer.json's "
    "is not one quantkit recognises.",
)
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def gguf_cmd(
    checkpoint: str,
    out: Path,
    qtype: str,
    dense_type: str,
    pre_tokenizer: str | None,
    force: bool,
    progress: bool,
) -> None:
    """A quantkit checkpoint (or a dense model) as one GGUF file for llama.cpp and Ollama."""
    if out.suffix.lower() != ".gguf":
        raise ExportError(f"-o: expected a file name ending in .gguf, got {str(out)!r}")
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to replace it")
    model_dir = Path(checkpoint)
    if not model_dir.is_dir():
        model_dir = resolve_model(checkpoint, progress=progress)
    report = export_gguf(
        model_dir,
        out,
        int4_type=qtype.lower(),
        dense_type=dense_type,
        pre_tokenizer=pre_tokenizer,
        progress=progress,
    )
    click.echo(report.summary())
