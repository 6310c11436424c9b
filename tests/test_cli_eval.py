"""`quantkit lm-eval` and `quantkit eval` end to end on a tiny model and a 20-item slice of
hand-made benchmark files, offline; and every bad input the issue names."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli as run

pytest.importorskip("lm_eval")

WORDS = "apple river stone cloud bread music garden window paper light".split()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$QUANTKIT_DATA with benchmarks/arc_easy.jsonl and lambada_openai.jsonl (20 items each)."""
    root = tmp_path_factory.mktemp("data")
    bench = root / "benchmarks"
    bench.mkdir()
    arc, lambada = [], []
    for i in range(20):
        choices = [WORDS[(i + k) % 10] for k in range(4)]
        arc.append(
            {"query": f"Question: Which word is number {i}?", "choices": choices, "gold": i % 4}
        )
        lambada.append(
            {
                "context": f"Simple is better than {WORDS[i % 10]} and",
                "continuation": WORDS[(i + 3) % 10],
            }
        )
    (bench / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    (bench / "lambada_openai.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lambada))
    return root


@pytest.fixture(autouse=True)
def _env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_root: Path, one_thread: None
) -> Iterator[None]:
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QUANTKIT_DATA", str(data_root))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # `quantkit lm-eval` runs lm-eval's setup_logging, whose handler keeps this test's captured
    # stderr; later tests would log into the closed stream. Drop what a test added.
    logger = logging.getLogger("lm_eval")
    handlers, propagate = list(logger.handlers), logger.propagate
    yield
    for h in logger.handlers[:]:
        if h not in handlers:
            logger.removeHandler(h)
    logger.propagate = propagate


def _one_error_line(code: int, err: str, *needles: str) -> None:
    """A non-zero exit with exactly one `error:` line and no traceback (lm-eval's own INFO log
    lines may come before it)."""
    assert code != 0
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in errors[0], (n, errors[0])


@pytest.fixture(scope="module")
def rtn_ckpt(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantize.pipeline import quantize_model

    outcome = quantize_model(tiny_model_dir, scheme=QuantScheme("int4", "auto"))
    return outcome.save(tmp_path_factory.mktemp("ckpt") / "tiny-rtn", source_dir=tiny_model_dir)


@pytest.fixture()
def no_wiki(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    """Held-out 'Wikipedia' tokens from hand-made text: parsing the real dump into a fresh
    QUANTKIT_HOME takes minutes on a busy 2-core machine."""
    import quantkit.quantize.calibration

    def fake(tokenizer, *, max_tokens, **_):
        text = " ".join(f"The {w} is better than the {v}." for w in WORDS for v in WORDS)
        return torch.tensor(tokenizer.encode(text))[:max_tokens]

    monkeypatch.setattr(quantkit.quantize.calibration, "heldout_tokens", fake)


def test_lm_eval_local_task_end_to_end(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    code, out, err = run(
        capsys,
        "lm-eval",
        "--model_args",
        f"pretrained={tiny_model_dir}",
        "--tasks",
        "quantkit_arc_easy",
        "--limit",
        "20",
        "--output_path",
        str(out_dir),
    )
    assert code == 0, err
    assert "quantkit_arc_easy" in out and "acc" in out
    (results_file,) = out_dir.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["quantkit_arc_easy"]["effective"] == 20
    assert 0.0 <= results["results"]["quantkit_arc_easy"]["acc,none"] <= 1.0


def test_lm_eval_user_yaml_via_include_path(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A user's own task YAML with a local JSON file (lm-eval's `datasets` path, offline)."""
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    rows = [{"text": f"Flat is better than {w}.", "label": w} for w in WORDS]
    (tasks / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "my_cloze.yaml").write_text(
        "task: my_cloze\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files: {{test: {tasks / 'items.jsonl'}}}\n"
        "output_type: loglikelihood\n"
        "test_split: test\n"
        'doc_to_text: "Flat is better than"\n'
        "doc_to_target: \"{{' ' + label + '.'}}\"\n"
        "metric_list:\n  - metric: acc\n"
    )
    code, out, err = run(
        capsys,
        "lm-eval",
        "--model_args",
        f"pretrained={tiny_model_dir}",
        "--include_path",
        str(tasks),
        "--tasks",
        "my_cloze",
    )
    assert code == 0, err
    assert "my_cloze" in out


def test_eval_table_and_json(capsys, tiny_model_dir: Path, rtn_ckpt: Path, tmp_path, no_wiki):
    # The reference itself as a second "checkpoint": recovery must be exactly 100%, KL 0.
    same = shutil.copytree(tiny_model_dir, tmp_path / "same")
    report = tmp_path / "eval.json"
    code, out, err = run(
        capsys,
        "eval",
        str(rtn_ckpt),
        str(same),
        "--reference",
        str(tiny_model_dir),
        "--tasks",
        "arc_easy,lambada",
        "--limit",
        "20",
        "--ppl-tokens",
        "200",
        "--window",
        "64",
        "--json",
        str(report),
        "--no-progress",
        "--cache",
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "task",
        "metric",
        "reference",
        "tiny-rtn",
        "rec",
        "%",
        "same",
        "rec",
        "%",
    ]
    assert any(ln.startswith("arc_easy") and " acc " in ln for ln in lines)
    assert any(ln.startswith("lambada") and "perplexity" in ln for ln in lines)
    data = json.loads(report.read_text())
    rows = {(r["task"], r["metric"]): r for r in data["table"]}
    acc = rows[("arc_easy", "acc")]
    assert acc["values"][1] == acc["reference"] and acc["recovery"][1] == pytest.approx(1.0)
    if acc["reference"] > 0:
        assert acc["recovery"][0] == pytest.approx(acc["values"][0] / acc["reference"])
    ppl = next(r for (t, m), r in rows.items() if t == "wiki held-out")
    assert ppl["recovery"][0] == pytest.approx(ppl["reference"] / ppl["values"][0])
    assert ppl["values"][1] == pytest.approx(ppl["reference"], rel=1e-5)
    kl = rows[("vs reference", "KL nats/tok")]["values"]
    top1 = rows[("vs reference", "top-1 agree")]["values"]
    assert kl[0] > 1e-4 and abs(kl[1]) < 1e-6  # INT4 differs from the reference; itself not
    assert top1[1] == 1.0 and top1[0] < 1.0
    assert data["reference"]["lm_eval"]["n-samples"]["quantkit_arc_easy"]["effective"] == 20
    assert data["checkpoints"][1]["scheme"] == "dense" != data["checkpoints"][0]["scheme"]


# --------------------------------------------------------------------------- bad input


def test_eval_unknown_task(capsys, tiny_model_dir: Path, rtn_ckpt: Path) -> None:
    code, _, err = run(
        capsys,
        "eval",
        str(rtn_ckpt),
        "--reference",
        str(tiny_model_dir),
        "--tasks",
        "arc_easy,hellaswag",
    )
    _one_error_line(code, err, "unknown task 'hellaswag'", "arc_easy, piqa")


def test_lm_eval_unknown_task(capsys, tiny_model_dir: Path) -> None:
    code, _, err = run(
        capsys,
        "lm-eval",
        "--model_args",
        f"pretrained={tiny_model_dir}",
        "--tasks",
        "quantkit_nope",
    )
    _one_error_line(code, err, "unknown task 'quantkit_nope'")


def test_eval_missing_data_file(capsys, tiny_model_dir, rtn_ckpt, tmp_path, monkeypatch, no_wiki):
    monkeypatch.setenv("QUANTKIT_DATA", str(tmp_path / "empty"))
    code, _, err = run(
        capsys,
        "eval",
        str(rtn_ckpt),
        "--reference",
        str(tiny_model_dir),
        "--tasks",
        "piqa",
        "--limit",
        "2",
        "--ppl-tokens",
        "0",
    )
    _one_error_line(
        code, err, str(tmp_path / "empty" / "benchmarks" / "piqa.jsonl"), "QUANTKIT_DATA"
    )


def test_eval_without_data_names_the_flag_and_variable(
    capsys, tiny_model_dir, rtn_ckpt, monkeypatch, no_wiki
) -> None:
    monkeypatch.delenv("QUANTKIT_DATA")  # and no --data-dir: there is no default folder
    code, _, err = run(
        capsys,
        "eval",
        str(rtn_ckpt),
        "--reference",
        str(tiny_model_dir),
        "--tasks",
        "piqa",
        "--limit",
        "2",
        "--ppl-tokens",
        "0",
    )
    _one_error_line(code, err, "no benchmark data", "--data-dir DIR", "set QUANTKIT_DATA")


@pytest.mark.parametrize("command", ["eval", "lm-eval"])
def test_checkpoint_without_tokenizer(capsys, tiny_model_dir, rtn_ckpt, tmp_path, command) -> None:
    bare = shutil.copytree(rtn_ckpt, tmp_path / "bare")
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            f.unlink()
    if command == "eval":
        args = ["eval", str(bare), "--reference", str(tiny_model_dir), "--limit", "2"]
    else:
        args = ["lm-eval", "--model_args", f"pretrained={bare}", "--tasks", "quantkit_arc_easy"]
    code, _, err = run(capsys, *args)
    _one_error_line(code, err, "tokenizer files missing", str(bare))


def test_eval_cache_reuses_answers(capsys, tiny_model_dir: Path, tmp_path, monkeypatch, no_wiki):
    from quantkit.evals.accuracy.lm_eval_model import QuantkitLM

    same = shutil.copytree(tiny_model_dir, tmp_path / "same")
    args = ["eval", str(same), "--reference", str(tiny_model_dir), "--tasks", "arc_easy"]
    args += ["--limit", "5", "--ppl-tokens", "0", "--no-progress", "--cache"]
    code, first, err = run(capsys, *args)
    assert code == 0, err

    def fail(*_a, **_k):
        raise AssertionError("the model ran although every answer was cached")

    monkeypatch.setattr(QuantkitLM, "_loglikelihood_tokens", fail)
    code, again, err = run(capsys, *args)
    assert code == 0, err
    assert again == first
    assert len(list((tmp_path / "home" / "eval-cache").glob("*.db"))) == 2
