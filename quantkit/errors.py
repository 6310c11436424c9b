"""Typed errors. Every message says what was expected and what was got.

The CLI catches `QuantkitError` and prints its message as one line; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class QuantkitError(Exception):
    """Base of every error a user can cause (bad input, bad files, missing extras)."""


class SchemeError(QuantkitError, ValueError):
    """A quantization scheme that is invalid or does not fit the model."""


class CheckpointError(QuantkitError):
    """A checkpoint directory that is missing, incomplete or inconsistent."""


class ModelSourceError(QuantkitError):
    """A MODEL argument that names nothing quantkit can load."""


class CalibrationError(QuantkitError):
    """Calibration text that is missing, unreadable or too short."""


class KernelUnavailableError(QuantkitError):
    """A requested kernel backend that cannot run here (no Triton, no CUDA, wrong dtype)."""


class GrammarError(QuantkitError):
    """A constraint (JSON schema, regex, choice) that cannot be compiled."""


class GenerationError(QuantkitError):
    """Bad generation input: empty prompt, out-of-range sampling option, too long a prompt."""


class EvalError(QuantkitError):
    """Bad evaluation input: unknown task, missing data file."""


class MissingExtraError(QuantkitError, ImportError):
    """An optional dependency is not installed."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module} is not installed; install it with: pip install 'quantkit[{extra}]'"
        )


class HardwareError(QuantkitError, ValueError):
    """An unknown GPU name or a device quantkit has no figures for."""
