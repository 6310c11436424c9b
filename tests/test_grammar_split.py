"""The grammar step's split (`evals.grammar.split`): each part's own time, the parts put back
after the run, and one run on the embedded model whose parts add up to its step."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from quantkit.errors import EvalError
from quantkit.evals.grammar.split import PARTS, REST, _Clock, main, timed_parts

pytestmark = pytest.mark.usefixtures("grammar_home")


def test_a_part_called_inside_another_counts_once() -> None:
    """Own times: the outer call's time less the inner's, so the two add up to the outer
    call's whole time (taken by a third, untimed clock around it)."""
    clock = _Clock()
    inner = clock.wrap("inner", lambda: sum(range(2000)))

    def outer_body() -> int:
        return inner() + inner() + sum(range(5000))

    outer = clock.wrap("outer", outer_body)
    whole = _Clock()
    around = whole.wrap("all", outer)
    around()
    assert clock.calls == {"inner": 2, "outer": 1}
    assert clock.own["inner"] > 0 and clock.own["outer"] > 0
    assert clock.own["inner"] + clock.own["outer"] == pytest.approx(whole.own["all"], rel=0.2)
    assert clock.own["inner"] + clock.own["outer"] <= whole.own["all"]


def test_every_part_names_a_method_and_is_put_back() -> None:
    originals = []
    for _, _, module, cls_name, method in PARTS:
        cls = getattr(importlib.import_module(module), cls_name)
        originals.append((cls, method, cls.__dict__[method]))
    clock = _Clock()
    with timed_parts(clock):
        assert all(cls.__dict__[m] is not fn for cls, m, fn in originals)
    assert all(cls.__dict__[m] is fn for cls, m, fn in originals)


def test_bad_arguments_are_one_error(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="expected --per-category and --max-new-tokens >= 1"):
        main(["--max-new-tokens", "0"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(EvalError, match=r"--schema .*bad.json: expected JSON, got"):
        main(["--schema", str(bad)])


@pytest.mark.slow
def test_a_run_on_the_demo_schema_adds_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], session_home: None
) -> None:
    """The demo's schema, a few tokens: the parts' times add up to the timed step's mean (to
    2%: the processor's call is timed from just outside it, its step from just inside), the
    verdict's llguidance call and the JSON row's text state took part, and the table prints
    each group. The real model from the shared cache, as the paired benchmark's test."""
    schema = Path(__file__).resolve().parents[1] / "examples" / "person.json"
    report = tmp_path / "split.json"
    code = main(["--schema", str(schema), "--max-new-tokens", "16", "--model", "smollm2-135m",
                 "--json", str(report)])  # fmt: skip
    data = json.loads(report.read_text())
    assert code == 0 and data["schemas"] == 1 and data["steps"] > 0
    parts = data["parts"]
    assert set(parts) == {label for label, *_ in PARTS} | {REST[0]}
    total = sum(p["us_per_step"] for p in parts.values())
    assert total == pytest.approx(data["timed_mean_us"], rel=0.02)
    assert parts[REST[0]]["us_per_step"] >= 0
    assert parts["verdict's try"]["calls_per_step"] > 0
    assert parts["text state"]["calls_per_step"] > 0
    out = capsys.readouterr().out
    assert "by group: llguidance" in out and "JSON row" in out and "processor" in out
