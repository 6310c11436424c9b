"""Where the offline lm-eval tasks get their items, and the names they go by.

The task YAMLs in `tasks/` name a loader from this module as their `custom_dataset`, so lm-eval
never calls `datasets.load_dataset` for them: no hub, no download, no dataset cache. The
multiple-choice and cloze sets are JSON-lines files (llm-foundry's local eval data) in the
benchmarks folder, found in this order:

1. `data_dir=PATH` from lm-eval's `--metadata` (or `TaskManager(metadata=...)`; `quantkit eval
   --data-dir PATH` passes it so),
2. `$QUANTKIT_DATA/benchmarks`, where $QUANTKIT_DATA is the project's data folder.

There is no default: with neither, the loaders raise an EvalError that names both. The tests
use the small subset in the repository's `tests/data/benchmarks`.

The perplexity task reads the held-out split of the Wikipedia sample used for calibration
(`quantkit.quantize.calibration.wiki_split`), so it never overlaps the AWQ calibration text.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError
from quantkit.paths import DATA_ENV, data_folder

__all__ = [
    "DATA_ENV",
    "LOCAL_TASKS",
    "TASKS_DIR",
    "benchmarks_dir",
    "check_task_data",
    "load_benchmark",
    "load_wikipedia",
    "read_jsonl",
    "resolve_task_names",
]

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# Short name (what `quantkit eval --tasks` takes) -> the lm-eval task name in tasks/*.yaml.
# The task names carry a prefix so that they never shadow lm-eval's own (hub-backed) tasks.
LOCAL_TASKS: dict[str, str] = {
    "arc_easy": "quantkit_arc_easy",
    "piqa": "quantkit_piqa",
    "boolq": "quantkit_boolq",
    "openbookqa": "quantkit_openbookqa",
    "copa": "quantkit_copa",
    "lambada": "quantkit_lambada_openai",
    "lambada_gen": "quantkit_lambada_gen",
    "wikipedia": "quantkit_wikipedia",
}
_ALIASES = {"openbook_qa": "openbookqa", "lambada_openai": "lambada", "wiki": "wikipedia"}


def benchmarks_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding the benchmark .jsonl files (see the module docstring for the order);
    EvalError when neither `data_dir` nor $QUANTKIT_DATA names one."""
    folder = data_folder("benchmarks", explicit=data_dir)
    if folder is not None:
        return folder
    raise EvalError(
        f"no benchmark data: pass --data-dir DIR (quantkit eval) or --metadata data_dir=DIR "
        f"(quantkit lm-eval) naming the folder of arc_easy.jsonl, piqa.jsonl, ..., or set "
        f"{DATA_ENV} to a folder holding benchmarks/arc_easy.jsonl, benchmarks/piqa.jsonl, ..."
    )


def read_jsonl(path: Path, *, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file, each checked to carry `fields`."""
    if not path.is_file():
        raise EvalError(
            f"benchmark file missing: expected {path}; set {DATA_ENV} to the data folder that "
            f"holds benchmarks/, or name the benchmarks folder with --data-dir (quantkit eval) "
            f"or --metadata data_dir=FOLDER (quantkit lm-eval)"
        )
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalError(f"{path}:{lineno}: expected a JSON object, got {e.msg}") from None
            missing = [k for k in fields if k not in row] if isinstance(row, dict) else fields
            if missing:
                raise EvalError(
                    f"{path}:{lineno}: expected the fields {', '.join(fields)}, "
                    f"missing {', '.join(missing)}"
                )
            rows.append(row)
    if not rows:
        raise EvalError(f"{path}: expected at least one item, got an empty file")
    return rows


def _dataset_dict(rows: list[dict[str, Any]]) -> Any:
    import datasets

    # An in-memory Dataset: nothing is written to the HF datasets cache.
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_benchmark(*, file: str, fields: list[str], data_dir: str | None = None, **_: Any) -> Any:
    """`custom_dataset` of the benchmark tasks: {"test": the rows of `file`}.

    lm-eval calls it with the task's metadata and model arguments as keywords too (its
    `--metadata` merges them); everything but `file`, `fields` and `data_dir` is ignored."""
    rows = read_jsonl(benchmarks_dir(data_dir) / file, fields=tuple(fields))
    for i, row in enumerate(rows):
        _check_row(f"{file} item {i}", row, fields)
    return _dataset_dict(rows)


def _check_row(where: str, row: dict[str, Any], fields: list[str]) -> None:
    """EvalError unless the text fields are text, `choices` a list of strings and `gold` an
    index into it (a row lm-eval would otherwise fail on deep inside, or score wrongly)."""
    for name in fields:
        if name not in ("choices", "gold") and not isinstance(row[name], str):
            raise EvalError(f"{where}: expected {name} as text, got {_shown(row[name])}")
    if "choices" in fields:
        choices = row["choices"]
        if not isinstance(choices, list) or not choices:
            raise EvalError(f"{where}: expected choices as a non-empty list, got {_shown(choices)}")
        if not all(isinstance(c, str) for c in choices):
            raise EvalError(f"{where}: expected choices as a list of strings, got {choices!r:.80}")
    if "gold" in fields:
        gold = row["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int):
            raise EvalError(f"{where}: expected gold as an integer index, got {_shown(gold)}")
        if "choices" in fields and not 0 <= gold < len(row["choices"]):
            raise EvalError(f"{where}: expected gold in [0, {len(row['choices'])}), got {gold}")


def check_task_data(task_names: list[str], data_dir: str | Path | None = None) -> None:
    """Read and check every row of the benchmark tasks among `task_names` (lm-eval names), as
    `load_benchmark` will: a missing folder or file, or a bad row, is an EvalError now, before
    any model loads, not after the first one has."""
    for name in task_names:
        kwargs = _dataset_kwargs(name)
        if kwargs is None:
            continue
        file, fields = kwargs["file"], list(kwargs["fields"])
        rows = read_jsonl(benchmarks_dir(data_dir) / file, fields=tuple(fields))
        for i, row in enumerate(rows):
            _check_row(f"{file} item {i}", row, fields)


def _dataset_kwargs(task: str) -> dict[str, Any] | None:
    """The `dataset_kwargs` of the task YAML in TASKS_DIR named `task`, if it is one read by
    `load_benchmark`; None for other tasks (the perplexity task, the user's own)."""
    return _benchmark_tasks().get(task)


@functools.cache
def _benchmark_tasks() -> dict[str, dict[str, Any]]:
    """task name -> `dataset_kwargs` of every YAML in TASKS_DIR whose loader is
    `load_benchmark` (read once)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    # The YAMLs name their loader with lm-eval's `!function` tag; here it is only text.
    _Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    tasks = {}
    for path in TASKS_DIR.glob("*.yaml"):
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
        if str(config.get("custom_dataset", "")).endswith("load_benchmark"):
            tasks[config["task"]] = config["dataset_kwargs"]
    return tasks


def _shown(value: Any) -> str:
    """A JSON value for a message: its type and (shortened) value."""
    return f"{type(value).__name__} {value!r:.60}"


def load_wikipedia(**_: Any) -> Any:
    """`custom_dataset` of the perplexity task: {"test": one row {"page": text} per held-out
    article of the Wikipedia sample}."""
    from quantkit.quantize.calibration import wiki_split

    return _dataset_dict([{"page": text} for text in wiki_split().heldout])


def resolve_task_names(names: list[str]) -> list[str]:
    """lm-eval task names for `quantkit eval --tasks`: short names (arc_easy, piqa, lambada, ...)
    or the full quantkit_* names. Anything else raises EvalError listing what exists."""
    out = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        short = _ALIASES.get(name, name)
        if short in LOCAL_TASKS:
            out.append(LOCAL_TASKS[short])
        elif name in LOCAL_TASKS.values():
            out.append(name)
        else:
            raise EvalError(
                f"unknown task {name!r}: expected one of {', '.join(LOCAL_TASKS)} "
                f"(or their quantkit_* names)"
            )
    if not out:
        raise EvalError("--tasks: expected at least one task name, got none")
    return list(dict.fromkeys(out))
