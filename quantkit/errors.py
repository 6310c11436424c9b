"""Typed errors. Every message says what was expected and what was got.

The CLI catches `QuantkitError`, prints its message as one line and exits with the class's
`exit_code`: 2 for a usage mistake (an option the command cannot take), 3 for input data that is
not what it claims (a damaged checkpoint, an unreadable model), 4 for the environment (a missing
extra, a backend this machine cannot run). Anything else is a bug (`quantkit.cli.main`).
"""

from __future__ import annotations


class QuantkitError(Exception):
    """Base of every error a user can cause (bad input, bad files, missing extras)."""

    exit_code = 2


class SchemeError(QuantkitError, ValueError):
    """A quantization scheme that is invalid or does not fit the model."""


class CheckpointError(QuantkitError):
    """A checkpoint directory that is missing, incomplete or inconsistent."""

    exit_code = 3


class ModelSourceError(QuantkitError):
    """A MODEL argument that names nothing quantkit can load."""

    exit_code = 3


class CalibrationError(QuantkitError):
    """Calibration text that is missing, unreadable or too short."""

    exit_code = 3


class ExportError(QuantkitError):
    """A checkpoint that cannot be written in the asked format (a GGUF type that cannot hold its
    codes, a family or tokenizer the format has no names for)."""

    exit_code = 3


class KernelUnavailableError(QuantkitError):
    """A requested kernel backend that cannot run here (no Triton, no CUDA, wrong dtype)."""

    exit_code = 4


class GrammarError(QuantkitError):
    """A constraint (JSON schema, regex, choice) that cannot be compiled."""


class GenerationError(QuantkitError):
    """Bad generation input: empty prompt, out-of-range sampling option, too long a prompt."""


class EvalError(QuantkitError):
    """Bad evaluation input: unknown task, missing data file."""

    exit_code = 3


class MissingExtraError(QuantkitError, ImportError):
    """An optional dependency is not installed."""

    exit_code = 4

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module} is not installed; install it with: pip install 'quantkit[{extra}]'"
        )


class HardwareError(QuantkitError, ValueError):
    """An unknown GPU name or a device quantkit has no figures for."""
