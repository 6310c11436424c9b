"""Running lm-eval offline: the environment, a task manager that knows quantkit's local tasks
without indexing lm-eval's 14k built-in ones, and `quantkit lm-eval` (lm-eval's own CLI).

lm-eval's CLI builds its `TaskManager` inside `EvaluatorConfig.process_tasks` with the built-in
tasks always indexed (30 s on a 2-core CPU, for 14,683 YAML files) and with no plugin hook for
extra task folders. `run_lm_eval_cli` therefore swaps the class that `process_tasks` looks up
(`lm_eval.tasks.TaskManager`, read at call time) for `local_task_manager` while the CLI runs,
and restores it afterwards: quantkit's tasks are always included, and the built-in index is only
built when a requested task is not found locally.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError, MissingExtraError
from quantkit.evals.accuracy.task_data import LOCAL_TASKS, TASKS_DIR
from quantkit.paths import quantkit_home

__all__ = [
    "EvalUsageError",
    "check_limit",
    "local_task_manager",
    "offline_env",
    "run_lm_eval_cli",
    "simple_evaluate",
]

_PREFIX = "quantkit_"


class EvalUsageError(EvalError):
    """An evaluation option the command cannot take: a usage mistake (exit 2), where an
    EvalError is about the data (exit 3)."""

    exit_code = 2


def check_limit(limit: float | None, *, fractions: bool = False) -> None:
    """EvalUsageError unless `limit` is None (every item) or a whole count >= 1; with
    `fractions` (lm-eval's --limit), also a fraction of the items in (0, 1)."""
    if limit is None:
        return
    count = math.isfinite(limit) and limit >= 1 and float(limit).is_integer()
    if count or (fractions and 0 < limit < 1):
        return
    shown = int(limit) if math.isfinite(limit) and float(limit).is_integer() else limit
    if fractions:
        raise EvalUsageError(
            f"--limit: expected a count of items >= 1 or a fraction in (0, 1), got {shown}"
        )
    raise EvalUsageError(f"--limit: expected an integer >= 1, got {shown}")


def offline_env() -> None:
    """Keep Hugging Face libraries off the network and give them a writable cache.

    Must run before `datasets` is imported (it reads the variables once). Values the user set
    are kept; HF_HOME moves to $QUANTKIT_HOME/huggingface only when it is unset and the default
    (~/.cache/huggingface) cannot be written."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "HF_HOME" in os.environ:
        return
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    default = Path(base) / "huggingface"
    try:
        default.mkdir(parents=True, exist_ok=True)
        writable = os.access(default, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        home = quantkit_home() / "huggingface"
        home.mkdir(parents=True, exist_ok=True)
        os.environ["HF_HOME"] = str(home)


def _require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise MissingExtraError("lm-eval", "eval") from e


class _QuietCustomDataset(logging.Filter):
    """Drops lm-eval's per-task hint about `--metadata` that every custom_dataset task logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def _quiet_lm_eval() -> None:
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDataset) for f in logger.filters):
        logger.addFilter(_QuietCustomDataset())


def _paths(include_path: str | Path | Sequence[str | Path] | None) -> list[Path]:
    if include_path is None:
        extra: list[str | Path] = []
    elif isinstance(include_path, (str, Path)):
        extra = [include_path]
    else:
        extra = list(include_path)
    for p in extra:
        if not Path(p).is_dir():
            raise EvalError(f"--include_path: expected a folder of task YAMLs, got {p}")
    # The user's folders come last: lm-eval lets later folders override earlier ones.
    return [TASKS_DIR, *(Path(p) for p in extra)]


def _wanted_names(tasks: Sequence[Any] | None) -> list[str]:
    """Requested task *names* (not YAML paths, folders or inline configs)."""
    names = []
    for t in tasks or []:
        if isinstance(t, str):
            for name in t.split(","):
                name = name.strip()
                if name and not name.endswith(".yaml") and not Path(name).exists():
                    names.append(name)
    return names


def local_task_manager(
    tasks: Sequence[Any] | None = None,
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """A TaskManager over quantkit's tasks (+ `include_path`). lm-eval's built-in tasks are
    indexed only if a name in `tasks` is not found there; a name that is nowhere raises
    EvalError (quantkit_* names are never looked up among the built-ins)."""
    _require_lm_eval()
    _quiet_lm_eval()
    from lm_eval.tasks.manager import TaskManager  # the real class, also while swapped

    paths = [str(p) for p in _paths(include_path)]
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    wanted = _wanted_names(tasks)
    missing = [n for n in wanted if not manager.match_tasks([n])]
    if any(n.startswith(_PREFIX) for n in missing):
        name = next(n for n in missing if n.startswith(_PREFIX))
        raise EvalError(
            f"unknown task {name!r}: expected one of the local tasks "
            f"{', '.join(sorted(LOCAL_TASKS.values()))}"
        )
    if missing:
        manager = TaskManager(include_path=paths, include_defaults=True, metadata=metadata)
        unknown = [n for n in missing if not manager.match_tasks([n])]
        if unknown:
            raise EvalError(
                f"unknown task {unknown[0]!r}: expected a quantkit task "
                f"({', '.join(sorted(LOCAL_TASKS.values()))}), an lm-eval task, or a task "
                f"YAML under --include_path"
            )
    return manager


class _Swap:
    """The TaskManager factory `run_lm_eval_cli` puts where lm-eval's CLI looks for it."""

    def __init__(self, tasks: Sequence[Any] | None) -> None:
        self.tasks = tasks

    def __call__(self, include_path: Any = None, metadata: Any = None, **_: Any) -> Any:
        if self.tasks is None:  # `lm-eval ls`: list everything, quantkit's tasks included
            from lm_eval.tasks.manager import TaskManager

            paths = [str(p) for p in _paths(include_path)]
            return TaskManager(include_path=paths, metadata=metadata)
        return local_task_manager(self.tasks, include_path=include_path, metadata=metadata)


@contextlib.contextmanager
def _swapped_task_manager(tasks: Sequence[Any] | None) -> Iterator[None]:
    import lm_eval.tasks

    original = lm_eval.tasks.TaskManager
    lm_eval.tasks.TaskManager = _Swap(tasks)  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = original  # type: ignore[misc]


def _check_pretrained(model_args: Any) -> None:
    """Load the tokenizer of `pretrained` before lm-eval starts, so that a wrong path or a
    checkpoint without tokenizer files is one error line, not one after lm-eval's set-up."""
    from lm_eval.utils import simple_parse_args_string

    from quantkit.sources.resolve import resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    args = simple_parse_args_string(model_args) if isinstance(model_args, str) else model_args
    pretrained = (args or {}).get("pretrained")
    if pretrained is None:
        raise EvalError(
            "--model_args: expected pretrained=CHECKPOINT (a quantkit checkpoint, a model "
            "directory, a .gguf file or smollm2-135m), got none"
        )
    load_tokenizer(resolve_model(str(pretrained)))


def run_lm_eval_cli(args: Sequence[str]) -> None:
    """lm-eval's command line with `args`, unchanged but for two things: `--model` defaults to
    quantkit, and quantkit's offline tasks are on the task path (see the module docstring)."""
    offline_env()
    _require_lm_eval()
    _quiet_lm_eval()
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    # "quantkit" is registered already: importing this module ran quantkit/evals/__init__.py.
    cli = HarnessCLI()
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        ns = cli.parse_args()  # reads sys.argv (it inserts "run" for the legacy form)
    finally:
        sys.argv = saved
    if getattr(ns, "command", None) == "run":
        check_limit(getattr(ns, "limit", None), fractions=True)
        if not ns.model:
            ns.model = "quantkit"
        if ns.model == "quantkit":
            _check_pretrained(ns.model_args)
        if ns.model == "quantkit" and not hasattr(ns, "batch_size"):
            # lm-eval's default batch size is 1; QuantkitLM bounds its batches by
            # max_batch_tokens, and one context per forward is ~10x slower on CPU.
            ns.batch_size = "auto"
    with _swapped_task_manager(getattr(ns, "tasks", None)):
        cli.execute(ns)


def simple_evaluate(
    lm: Any,
    tasks: list[str],
    *,
    limit: int | None,
    metadata: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict:
    """lm-eval's `simple_evaluate` on quantkit's task manager, without per-sample logs.
    `metadata` reaches the tasks' data loaders (e.g. data_dir)."""
    offline_env()
    _require_lm_eval()
    from lm_eval import simple_evaluate as evaluate

    # lm-eval prints progress notes ("bootstrapping for stddev") to stdout, where the caller's
    # table goes; they belong with the progress bars on stderr.
    with contextlib.redirect_stdout(sys.stderr):
        results = evaluate(
            model=lm,
            tasks=tasks,
            limit=limit,
            task_manager=local_task_manager(tasks, metadata=metadata),
            log_samples=False,
            **kwargs,
        )
    if results is None:  # only non-zero ranks of a distributed run get None
        raise EvalError("lm-eval returned no results")
    return results
