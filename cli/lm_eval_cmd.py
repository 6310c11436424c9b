"""`quantkit lm-eval ARGS...`: lm-eval's own command line with quantkit's model and tasks.

lm-eval discovers no plugins from its command line, so this command registers the "quantkit"
model, puts the offline tasks (quantkit_arc_easy, ... see
`quantkit.evals.accuracy.task_data`) on the task path, and hands every argument to lm-eval
unchanged; `--model` defaults to quantkit.
"""

from __future__ import annotations

import click

from quantkit.evals.accuracy.harness import run_lm_eval_cli


@click.command(
    "lm-eval",
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        # --help goes to lm-eval, whose options are the ones that matter here.
        "help_option_names": [],
    },
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_cmd(args: tuple[str, ...]) -> None:
    """Run lm-eval's CLI with quantkit models, e.g. quantkit lm-eval --model_args
    pretrained=CKPT --tasks quantkit_arc_easy --limit 200 (offline; --help: lm-eval's options)."""
    run_lm_eval_cli(list(args))
