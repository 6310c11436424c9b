"""The `quantkit` command group. Thin: parse, call the library, print.

A user mistake (any `QuantkitError`) prints one line on stderr and exits 2; Ctrl-C prints one
line and exits 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import click

from quantkit import __version__
from quantkit.cli.bench_cmd import bench_cmd
from quantkit.cli.eval_cmd import eval_cmd
from quantkit.cli.generate_cmd import generate_cmd
from quantkit.cli.inspect_cmd import inspect_cmd
from quantkit.cli.lm_eval_cmd import lm_eval_cmd
from quantkit.cli.quantize_cmd import quantize_cmd
from quantkit.cli.roofline_cmd import roofline_cmd
from quantkit.errors import QuantkitError


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


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="quantkit", standalone_mode=False)
    except QuantkitError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("interrupted; nothing was written", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("interrupted; nothing was written", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
