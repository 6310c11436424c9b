"""JSON-Schema-Test-Suite, keyword by keyword: which keywords compile, and is the grammar sound?

For every schema group of a draft's test files (one file per keyword), lower the schema to its
regex; then, for each test instance, ask whether the regex matches the instance's compact JSON
text (the regex's own language, a superset of what the index can generate: see `acceptance`).
Reported per keyword:

- groups lowered / total, and the GrammarError messages of the rest (the unsupported list);
- soundness: invalid instances rejected / invalid instances of compiled groups. Must be 100%:
  an accepted invalid instance is an output the constraint would let through;
- completeness: valid instances accepted / valid instances of compiled groups (the grammar may
  be narrower than the schema: lower is allowed, it only costs choice).

Usage: python -m quantkit.evals.grammar.testsuite [--draft draft2020-12] [--data DIR] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError, GrammarError
from quantkit.evals.common import run_main, write_json_atomic
from quantkit.evals.grammar.data import DATA_ENV, classify_error
from quantkit.grammar.acceptance import accepts_text
from quantkit.grammar.constraints import json_schema_grammar
from quantkit.paths import data_folder

__all__ = ["SUITE_ENV", "KeywordReport", "default_suite_dir", "main", "run_suite"]

SUITE_ENV = "QUANTKIT_JSON_SCHEMA_TEST_SUITE"  # the test suite's root folder itself


def default_suite_dir() -> Path:
    """$QUANTKIT_JSON_SCHEMA_TEST_SUITE, else $QUANTKIT_DATA/json-schema-test-suite; EvalError
    when neither is set (there is no default: pass --data or set one of the two)."""
    folder = data_folder("json-schema-test-suite", env=SUITE_ENV)
    if folder is not None:
        return folder
    raise EvalError(
        f"no JSON-Schema-Test-Suite data: pass --data DIR or set {SUITE_ENV}=DIR (a folder "
        f"holding tests/draft2020-12/*.json), or set {DATA_ENV} to a folder holding "
        f"json-schema-test-suite/"
    )


@dataclass
class KeywordReport:
    keyword: str
    groups: int = 0
    compiled: int = 0
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    errors: list[str] = field(default_factory=list)
    unsound: list[str] = field(default_factory=list)  # "group / test" accepted though invalid


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def run_suite(folder: Path, *, files: list[str] | None = None) -> list[KeywordReport]:
    """One report per test file (keyword) in `folder` (e.g. tests/draft2020-12)."""
    reports = []
    for path in sorted(folder.glob("*.json")):
        if files is not None and path.stem not in files:
            continue
        report = KeywordReport(path.stem)
        for group in json.loads(path.read_text(encoding="utf-8")):
            report.groups += 1
            try:
                grammar = json_schema_grammar(group["schema"], label=group["description"])
            except GrammarError as e:
                report.errors.append(f"{group['description']}: {e}")
                continue
            report.compiled += 1
            for test in group["tests"]:
                accepted = accepts_text(grammar.regex, _compact(test["data"]))
                if test["valid"]:
                    report.valid += 1
                    report.valid_accepted += accepted
                else:
                    report.invalid += 1
                    report.invalid_rejected += not accepted
                    if accepted:
                        report.unsound.append(f"{group['description']} / {test['description']}")
        reports.append(report)
    return reports


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "    -"


def print_reports(reports: list[KeywordReport]) -> None:
    print(f"{'keyword':<28} {'lowered':>9} {'sound':>7} {'complete':>9}")
    for r in reports:
        print(
            f"{r.keyword:<28} {r.compiled:>4}/{r.groups:<4} {_pct(r.invalid_rejected, r.invalid)} "
            f"  {_pct(r.valid_accepted, r.valid)}"
        )
    total = {k: sum(getattr(r, k) for r in reports) for k in asdict(reports[0]) if k not in
             ("keyword", "errors", "unsound")} if reports else {}  # fmt: skip
    if total:
        print(
            f"{'ALL':<28} {total['compiled']:>4}/{total['groups']:<4} "
            f"{_pct(total['invalid_rejected'], total['invalid'])}   "
            f"{_pct(total['valid_accepted'], total['valid'])}"
        )
    unsupported = [r for r in reports if r.errors]
    print("\nkeywords with groups that raise GrammarError (first message each):")
    for r in unsupported:
        print(f"  {r.keyword} ({len(r.errors)}/{r.groups}): {r.errors[0][:160]}")
    causes: dict[str, list[str]] = defaultdict(list)
    for r in unsupported:
        for error in r.errors:
            causes[classify_error(error.split(": ", 1)[-1])].append(error)
    print("\nGrammarError causes over all groups (what is unsupported, and one message):")
    for cause, errors in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        print(f"  {cause:<32} {len(errors):>3}  {errors[0].split(': ', 1)[-1][:110]}")
    unsound = [u for r in reports for u in r.unsound]
    print(f"\nunsound acceptances (invalid instance accepted): {len(unsound)}")
    for u in unsound[:20]:
        print(f"  {u}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.testsuite")
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="the test suite's root folder (default: $QUANTKIT_JSON_SCHEMA_TEST_SUITE, else "
        "$QUANTKIT_DATA/json-schema-test-suite)",
    )
    parser.add_argument("--draft", default="draft2020-12")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    try:
        folder = (args.data or default_suite_dir()) / "tests" / args.draft
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not folder.is_dir():
        print(f"error: expected the test suite at {folder}, found nothing", file=sys.stderr)
        return 2
    started = time.perf_counter()
    reports = run_suite(folder)
    print_reports(reports)
    print(f"\n{args.draft}: {time.perf_counter() - started:.0f} s")
    if args.json:
        write_json_atomic(args.json, [asdict(r) for r in reports])
    return 0


if __name__ == "__main__":
    run_main(main)
