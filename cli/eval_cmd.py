"""`quantkit eval CKPT [CKPT...] --reference MODEL`: what quantization cost, on one table."""

from __future__ import annotations

from pathlib import Path

import click
import torch

from quantkit.errors import EvalError
from quantkit.evals.accuracy.compare import compare_models, format_table, write_json
from quantkit.evals.accuracy.harness import check_limit
from quantkit.evals.accuracy.task_data import LOCAL_TASKS
from quantkit.paths import quantkit_home


@click.command("eval")
@click.argument("checkpoints", nargs=-1, required=True)
@click.option(
    "--reference",
    required=True,
    help="The unquantized model: a HF directory, a .gguf file, or smollm2-135m.",
)
@click.option(
    "--tasks",
    default="arc_easy,piqa,lambada",
    show_default=True,
    help=f"Comma-separated, from: {', '.join(LOCAL_TASKS)}.",
)
@click.option("--limit", type=int, default=None, help="Items per task (default: all).")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the table and the full lm-eval results here.",
)
@click.option(
    "--ppl-tokens",
    type=int,
    default=8192,
    show_default=True,
    help="Held-out Wikipedia tokens for perplexity and KL/top-1 (0 skips them).",
)
@click.option("--window", type=int, default=512, show_default=True, help="Perplexity window.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Contexts per batch.")
@click.option(
    "--max-batch-tokens",
    type=int,
    default=2048,
    show_default=True,
    help="Tokens per forward pass, padding included (bounds memory).",
)
@click.option(
    "--add-bos/--no-add-bos",
    default=None,
    help="Start every sequence with BOS (default: the tokenizer's own behaviour).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder of the benchmark .jsonl files (default: $QUANTKIT_DATA/benchmarks; the "
    "benchmark tasks need one of the two).",
)
@click.option(
    "--cache",
    is_flag=True,
    help="Reuse each unchanged model's lm-eval answers from $QUANTKIT_HOME/eval-cache.",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="CPU threads for torch [default: torch's choice; 1 wastes least on a busy machine].",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="Activations and dense weights of every model; auto = bfloat16 on a CPU with bf16 "
    "matmul instructions (3-4x faster prefill here), else float32.",
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def eval_cmd(
    checkpoints: tuple[str, ...],
    reference: str,
    tasks: str,
    limit: int | None,
    json_path: Path | None,
    ppl_tokens: int,
    window: int,
    batch_size: int,
    max_batch_tokens: int,
    add_bos: bool | None,
    data_dir: Path | None,
    cache: bool,
    threads: int | None,
    dtype: str,
    no_progress: bool,
) -> None:
    """Compare quantized CHECKPOINTS with --reference on lm-eval tasks (offline), held-out
    perplexity and next-token KL / top-1 agreement; print one table with recovery %."""
    check_limit(limit)  # a usage mistake: exit 2 before any model loads
    if threads is not None:
        if threads < 1:
            raise EvalError(f"--threads: expected an integer >= 1, got {threads}")
        # Measured on the shared 2-core machine under load: 2 threads spent 5x the CPU time of
        # 1 on the same requests (OpenMP workers spin while their partner is descheduled).
        torch.set_num_threads(threads)
    comparison = compare_models(
        list(checkpoints),
        reference=reference,
        tasks=tasks.split(","),
        limit=limit,
        ppl_tokens=ppl_tokens,
        window=window,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        add_bos_token=add_bos,
        data_dir=data_dir,
        cache_dir=quantkit_home() / "eval-cache" if cache else None,
        progress=not no_progress,
        log=lambda msg: click.echo(msg, err=True),
        dtype=_eval_dtype(dtype),
    )
    click.echo(format_table(comparison))
    if json_path is not None:
        write_json(comparison, json_path)
        click.echo(f"wrote {json_path}")


def _eval_dtype(name: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    from quantkit.cpu import has_bf16_dot

    # Models are evaluated on the CPU. Measured on SmolLM2-135M, 4 x 256 tokens, 2 threads:
    # 1495 ms fp32 vs 468 ms bf16 (dense), 1927 vs 510 ms (INT4). Without bf16 instructions
    # bf16 matmuls are emulated and slower than fp32.
    return torch.bfloat16 if has_bf16_dot() else torch.float32
