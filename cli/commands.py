"""The `quantkit` command group: every subcommand, registered once.

Imported by `quantkit.cli.main` inside its error boundary (these imports pull in torch and take
seconds, and a Ctrl-C or a broken install during them must still end in one line).
"""

from __future__ import annotations

import click

from quantkit import __version__
from quantkit.cli.bench_cmd import bench_cmd
from quantkit.cli.eval_cmd import eval_cmd
from quantkit.cli.export_cmd import export_cmd
from quantkit.cli.generate_cmd import generate_cmd
from quantkit.cli.inspect_cmd import inspect_cmd
from quantkit.cli.lm_eval_cmd import lm_eval_cmd
from quantkit.cli.quantize_cmd import quantize_cmd
from quantkit.cli.roofline_cmd import roofline_cmd
from quantkit.cli.serve_cmd import serve_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantkit")
def cli() -> None:
    """Quantize causal LMs (AWQ INT4, FP8), write compressed-tensors checkpoints, run them."""


cli.add_command(quantize_cmd)
cli.add_command(inspect_cmd)
cli.add_command(generate_cmd)
cli.add_command(roofline_cmd)
cli.add_command(eval_cmd)
cli.add_command(lm_eval_cmd)
cli.add_command(bench_cmd)
cli.add_command(serve_cmd)
cli.add_command(export_cmd)
