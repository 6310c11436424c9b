"""JSONSchemaBench in CI: the fixed sample, error classes, a few schemas' regex soundness, and
(slow) a short generation run with the real embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.errors import EvalError
from quantkit.evals.grammar.data import (
    BENCH_ENV,
    DATA_ENV,
    category_of,
    classify_error,
    default_bench_dir,
    sample_schemas,
)
from quantkit.evals.grammar.report import print_report, recompile_summary, totals
from quantkit.grammar.acceptance import accepts_text
from quantkit.grammar.constraints import json_schema_grammar

# A JSONSchemaBench subset in the benchmark's layout: 3 schemas per category, 1 of Github_ultra
# (see tests/data/jsonschemabench/README.md).
FIXTURE_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture()
def bench_dir(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The subset, found as the bench finds its data: through $QUANTKIT_DATA."""
    monkeypatch.delenv(BENCH_ENV, raising=False)
    monkeypatch.setenv(DATA_ENV, str(FIXTURE_DATA))
    folder = default_bench_dir()
    assert folder == FIXTURE_DATA / "jsonschemabench"
    return folder


def test_bench_dir_comes_from_the_variables_or_the_error_names_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    monkeypatch.setenv(BENCH_ENV, str(tmp_path / "bench"))
    assert default_bench_dir() == tmp_path / "bench"
    monkeypatch.delenv(BENCH_ENV)
    assert default_bench_dir() == tmp_path / "data" / "jsonschemabench"
    monkeypatch.delenv(DATA_ENV)
    with pytest.raises(EvalError) as err:
        default_bench_dir()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("no JSONSchemaBench data: pass --data DIR")
    assert BENCH_ENV in msg and DATA_ENV in msg
    from quantkit.evals.grammar.jsonschema import main

    assert main(["--no-generate"]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"


def test_category_and_error_classes() -> None:
    assert category_of("Github_easy---o1.json") == "Github_easy"
    assert category_of("BFCL_parallel_multiple_3.json") == "BFCL"
    assert category_of("JME_7.json") == "JME"
    assert classify_error("#/a: keyword 'not': negation ...") == "unsupported: not"
    assert classify_error("x: compiling the grammar took longer than the limit of 1 s") == (
        "compile timeout"
    )
    assert classify_error("schema: expected a valid JSON Schema, got ...") == "invalid schema"


def test_sample_is_fixed_and_spans_the_categories(bench_dir: Path) -> None:
    first = sample_schemas(bench_dir, per_category=15)
    again = sample_schemas(bench_dir, per_category=15)
    assert [s.name for s in first] == [s.name for s in again]
    # The subset: 14 categories of 3 schemas and Github_ultra's 1; 15 a category takes them all.
    assert len(first) == 43 and len({s.category for s in first}) == 15
    assert len({s.name for s in first}) == len(first)
    # Interleaved: the first schemas already cover many categories (--limit stays diverse).
    assert len({s.category for s in first[:15]}) == 15
    two = sample_schemas(bench_dir, per_category=2, limit=20)
    assert len(two) == 20 and len({s.category for s in two[:15]}) == 15
    assert {s.name for s in two} <= {s.name for s in first}


def test_sample_of_chosen_categories(bench_dir: Path) -> None:
    items = sample_schemas(bench_dir, per_category=2, categories=["Glaiveai2K", "BFCL"])
    assert {s.category for s in items} == {"Glaiveai2K", "BFCL"} and len(items) == 4
    assert [s.category for s in items] == ["BFCL", "Glaiveai2K"] * 2  # interleaved
    every = sample_schemas(bench_dir, per_category=40, categories=["Glaiveai2K", "BFCL"])
    assert len(every) == 6 and {s.name for s in items} < {s.name for s in every}
    assert sample_schemas(bench_dir, categories=["NoSuchCategory"]) == []


def _row(name: str, category: str, **fields: object) -> dict[str, object]:
    row: dict[str, object] = {
        "name": name, "category": category, "compiled": True, "error": None,
        "error_kind": None, "compile_s": 0.1, "compile_source": "compiled",
        "recompile_s": 0.01, "valid_tests": 2, "valid_accepted": 2, "invalid_tests": 2,
        "invalid_rejected": 2, "finish": "stop", "output_ok": True, "output_error": None,
        "output": "{}", "new_tokens": 5, "steered": False,
    }  # fmt: skip
    row.update(fields)
    return row


def test_report_counts_every_rate_the_issue_asks_for(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        _row("g1", "Glaiveai2K"),
        _row("g2", "Glaiveai2K", finish="length", output_ok=None, steered=True),
        _row("g3", "Glaiveai2K", compiled=False, error="#: keyword 'not': ...",
             error_kind="unsupported: not", finish=None, output_ok=None, recompile_s=None,
             valid_tests=0, valid_accepted=0, invalid_tests=0, invalid_rejected=0),
        _row("b1", "BFCL", invalid_rejected=1, valid_accepted=1, recompile_s=0.2),
        _row("b2", "BFCL", output_ok=False, output_error="invalid at (root): boom"),
    ]  # fmt: skip
    t = totals(rows)
    assert (t["compiled"], t["generated"], t["finished"], t["finished_valid"]) == (4, 4, 3, 2)
    assert (t["hit_limit"], t["steered"], t["invalid_rejected"], t["invalid_tests"]) == (1, 1, 7, 8)
    assert recompile_summary(rows)["under_100ms"] == 3
    report = {"model": "m", "max_new_tokens": 512, "batch": 1, "compile_timeout_s": 30.0,
              "results": rows, "recompile": recompile_summary(rows), "mask": {}}  # fmt: skip
    print_report(report)
    out = capsys.readouterr().out
    assert "declared coverage     4/5 (80.0%)" in out
    assert "GrammarError: unsupported: not" in out and "e.g. g3" in out
    assert "invalid instances rejected 7/8 (87.5%)" in out and "UNSOUND b1" in out
    assert "agreement           14/16 (87.5%)" in out
    assert "parse and validate 2/3 (66.7%)" in out and "INVALID b2: invalid at (root)" in out
    assert "hit the token limit   1/4 (25.0%)" in out
    assert "compliance            2/4 (50.0%)" in out and "empirical coverage    2/5" in out
    assert "GlaiveAI (3 schemas): declared coverage 0.67, compliance 0.50" in out
    assert "Outlines 0.96" in out and "3/4 under 0.1 s" in out


def test_small_subset_is_sound_on_its_test_instances(bench_dir: Path) -> None:
    items = [s for s in sample_schemas(bench_dir, per_category=1) if s.tests][:12]
    lowered = checked = 0
    for item in items:
        try:
            grammar = json_schema_grammar(item.schema, label=item.name)
        except Exception as e:  # noqa: BLE001 (only GrammarError is allowed: checked below)
            assert type(e).__name__ == "GrammarError", (item.name, e)
            continue
        lowered += 1
        if len(grammar.regex) > 20_000:  # Python's re may backtrack for long on huge regexes
            continue
        for test in item.tests[:6]:
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            if not test["valid"]:
                assert not accepts_text(grammar.regex, text), (item.name, test["description"])
            checked += 1
    assert lowered >= len(items) // 2 and checked >= 10


@pytest.mark.slow
def test_generation_on_the_embedded_model(session_home: None, bench_dir: Path) -> None:
    """Two small schemas, 32 new tokens, the real model from the shared cache (converting it
    again into a temporary home would take longer than the test); no index is cached."""
    from quantkit.evals.grammar.jsonschema import SchemaResult, run_bench

    names = ["Glaiveai2K", "BFCL"]
    items = [s for s in sample_schemas(bench_dir, per_category=1) if s.category in names]
    report = run_bench(
        items, model="smollm2-135m", max_new_tokens=32, cache=False, log=lambda _: None
    )
    results = [SchemaResult(**r) for r in report["results"]]
    assert sum(r.compiled for r in results) == 2
    for r in results:
        if r.finish == "stop":
            assert r.output_ok, (r.name, r.output_error, r.output)
        assert r.invalid_rejected == r.invalid_tests, r.name
    assert report["mask"]["steps"] > 0 and report["mask"]["mean_us"] > 0


def test_table_shares_round_down_so_a_target_is_never_shown_met() -> None:
    from quantkit.evals.grammar.report import _cell

    assert _cell(5804, 5951) == "5804/5951  97.5%"
    assert _cell(4999, 5000).endswith(" 99.9%") and _cell(49, 50).endswith(" 98.0%")
    assert _cell(3, 3).endswith("100.0%") and _cell(0, 0) == "-"
