"""The offline tasks: data lookup, loaders, task names, and the local task manager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.errors import EvalError
from quantkit.evals.accuracy.task_data import (
    DATA_ENV,
    LOCAL_TASKS,
    TASKS_DIR,
    benchmarks_dir,
    load_benchmark,
    read_jsonl,
    resolve_task_names,
)

MC = {"query": "Question: Which is a fruit?", "choices": ["apple", "chair"], "gold": 0}
# The first 24 items of each benchmark file, in the data folder's layout (see its README.md).
FIXTURE_DATA = Path(__file__).resolve().parent / "data"


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_short_name_has_a_yaml() -> None:
    import yaml

    names = set()
    for f in TASKS_DIR.glob("*.yaml"):
        # !function tags are lm-eval's; the plain loader only needs the task name.
        text = "\n".join(ln for ln in f.read_text().splitlines() if "!function" not in ln)
        names.add(yaml.safe_load(text)["task"])
    assert names == set(LOCAL_TASKS.values())


def test_resolve_task_names() -> None:
    assert resolve_task_names(["arc_easy", " piqa", "lambada_openai", "quantkit_copa"]) == [
        "quantkit_arc_easy",
        "quantkit_piqa",
        "quantkit_lambada_openai",
        "quantkit_copa",
    ]
    assert resolve_task_names(["openbook_qa", "openbookqa"]) == ["quantkit_openbookqa"]
    with pytest.raises(EvalError, match=r"unknown task 'hellaswag': expected one of arc_easy"):
        resolve_task_names(["arc_easy", "hellaswag"])
    with pytest.raises(EvalError, match="expected at least one task name"):
        resolve_task_names(["", " "])


def test_benchmarks_dir_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    assert benchmarks_dir() == tmp_path / "data" / "benchmarks"
    assert benchmarks_dir(tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.delenv(DATA_ENV)
    assert benchmarks_dir(tmp_path / "mine") == tmp_path / "mine"
    # No default folder: one line naming the flag and the variable.
    with pytest.raises(EvalError) as err:
        benchmarks_dir()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("no benchmark data: pass --data-dir DIR")
    assert f"set {DATA_ENV} to a folder holding benchmarks/arc_easy.jsonl" in msg
    with pytest.raises(EvalError, match=f"no benchmark data: .*{DATA_ENV}"):
        load_benchmark(file="arc_easy.jsonl", fields=["query"])


def test_missing_file_names_it_and_the_variable(tmp_path: Path) -> None:
    with pytest.raises(EvalError) as err:
        load_benchmark(file="arc_easy.jsonl", fields=["query"], data_dir=str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path / "arc_easy.jsonl") in msg and DATA_ENV in msg


def test_bad_rows(tmp_path: Path) -> None:
    f = tmp_path / "x.jsonl"
    f.write_text('{"query": "q", "choices": ["a"], "gold": 0}\nnot json\n')
    with pytest.raises(EvalError, match=r"x.jsonl:2: expected a JSON object"):
        read_jsonl(f, fields=("query",))
    _write(f, [{"query": "q"}])
    with pytest.raises(
        EvalError, match=r"x.jsonl:1: expected the fields query, gold, missing gold"
    ):
        read_jsonl(f, fields=("query", "gold"))
    _write(f, [dict(MC, gold=2)])
    with pytest.raises(EvalError, match=r"item 0: expected gold in \[0, 2\), got 2"):
        load_benchmark(file="x.jsonl", fields=["query", "choices", "gold"], data_dir=str(tmp_path))
    f.write_text("\n")
    with pytest.raises(EvalError, match="expected at least one item"):
        read_jsonl(f, fields=("query",))


def test_loader_ignores_lm_eval_metadata(tmp_path: Path) -> None:
    _write(tmp_path / "arc_easy.jsonl", [MC, dict(MC, gold=1)])
    ds = load_benchmark(
        file="arc_easy.jsonl",
        fields=["query", "choices", "gold"],
        data_dir=str(tmp_path),
        version=1.0,
        pretrained="whatever",
    )
    assert ds["test"].num_rows == 2 and ds["test"][1]["gold"] == 1


# --------------------------------------------------------------------------- with lm-eval


@pytest.fixture()
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    _write(tmp_path / "benchmarks" / "piqa.jsonl", [dict(MC, query="Question: eat?\n")])
    return tmp_path / "benchmarks"


def test_local_task_manager_renders_prompts(data: Path) -> None:
    from quantkit.evals.accuracy.harness import local_task_manager

    manager = local_task_manager(["quantkit_piqa"])
    assert set(LOCAL_TASKS.values()) <= set(manager.all_tasks)
    assert "arc_easy" not in manager.all_tasks  # lm-eval's built-ins were not indexed
    task = manager.load(["quantkit_piqa"])["tasks"]["quantkit_piqa"]
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == "Question: eat?\nAnswer:"
    assert task.doc_to_choice(doc) == ["apple", "chair"]


def test_unknown_local_task_fails_fast(data: Path) -> None:
    from quantkit.evals.accuracy.harness import local_task_manager

    with pytest.raises(EvalError, match="unknown task 'quantkit_nope': expected one of"):
        local_task_manager(["quantkit_nope"])
    with pytest.raises(EvalError, match="--include_path: expected a folder of task YAMLs"):
        local_task_manager(["quantkit_piqa"], include_path=data / "absent")


def test_real_benchmark_files_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped YAMLs on real items: the subset in tests/data, found through $QUANTKIT_DATA."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv(DATA_ENV, str(FIXTURE_DATA))
    from quantkit.evals.accuracy.harness import local_task_manager

    names = [n for n in LOCAL_TASKS.values() if n != "quantkit_wikipedia"]
    tasks = local_task_manager(names).load(names)["tasks"]
    counts = {}
    for name, task in tasks.items():
        docs = list(task.test_docs())
        counts[name] = len(docs)
        text = task.doc_to_text(docs[0])
        assert text and not text.endswith(" "), (name, text)
    assert counts == dict.fromkeys(names, 24)  # every item of every file, none dropped
    # The YAMLs read the files they name: the first ARC-Easy item is the file's first line.
    first = json.loads((FIXTURE_DATA / "benchmarks" / "arc_easy.jsonl").read_text().split("\n")[0])
    arc = next(iter(tasks["quantkit_arc_easy"].test_docs()))
    assert tasks["quantkit_arc_easy"].doc_to_choice(arc) == first["choices"]
