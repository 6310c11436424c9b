"""The JSONSchemaBench report: one row per category, then the totals the issue asks for.

Terms (as in the JSONSchemaBench paper, Geng et al. 2025):

- declared coverage: schemas that compile within the limit / schemas tried;
- compliance: compiled schemas whose output finished (EOS in an accepting state) and validates
  against the schema / compiled schemas;
- empirical coverage: schemas with a finished, valid output / schemas tried
  (= declared coverage x compliance).

Kept apart from `jsonschema` (which runs the benchmark) so both stay small.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from quantkit.evals.grammar.data import PUBLISHED_GLAIVE

__all__ = ["fill_summary", "mask_summary", "print_report", "recompile_summary", "totals"]


def mask_summary(mask_s: Sequence[float], step_s: Sequence[float]) -> dict[str, float]:
    """Mean and p99 of the mask time per decode step (us) and its share of the step time."""
    if not mask_s or not step_s:
        return {}
    mask = np.asarray(mask_s) * 1e6
    return {
        "steps": len(mask),
        "mean_us": float(mask.mean()),
        "p99_us": float(np.percentile(mask, 99)),
        "step_mean_ms": float(np.mean(step_s) * 1e3),
        "share": float(np.sum(mask_s) / np.sum(step_s)),
    }


def fill_summary(fill_s: Sequence[float]) -> dict[str, float]:
    """Mean and p99 (us) of the engine's bitmask fill alone, per step of the valid instances."""
    if not fill_s:
        return {}
    fill = np.asarray(fill_s) * 1e6
    return {"steps": len(fill), "mean_us": float(fill.mean()),
            "p99_us": float(np.percentile(fill, 99))}  # fmt: skip


def recompile_summary(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median, p90 and max of the cached recompile times (s), and how many are under 0.1 s."""
    times = [r["recompile_s"] for r in results if r.get("recompile_s") is not None]
    if not times:
        return {}
    arr = np.asarray(times)
    return {
        "n": len(arr),
        "median_s": float(np.median(arr)),
        "p90_s": float(np.percentile(arr, 90)),
        "max_s": float(arr.max()),
        "under_100ms": int((arr < 0.1).sum()),
    }


def totals(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Counts over `results` (SchemaResult dicts) that every rate of the report is made of."""
    gen = [r for r in results if r["finish"] is not None]
    fin = [r for r in gen if r["finish"] == "stop"]
    compiled = [r for r in results if r["compiled"]]
    return {
        "schemas": len(results),
        "compiled": len(compiled),
        "generated": len(gen),
        "finished": len(fin),
        "finished_valid": sum(bool(r["output_ok"]) for r in fin),
        "hit_limit": len(gen) - len(fin),
        "steered": sum(bool(r["steered"]) for r in gen),
        "valid_tests": sum(r["valid_tests"] for r in compiled),
        "valid_accepted": sum(r["valid_accepted"] for r in compiled),
        "invalid_tests": sum(r["invalid_tests"] for r in compiled),
        "invalid_rejected": sum(r["invalid_rejected"] for r in compiled),
    }


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.1f}%)" if whole else "-"


def _cell(part: int, whole: int) -> str:
    """part/whole and the share, rounded down to 0.1%: 97.96% reads 97.9, never a target met."""
    return f"{part}/{whole} {math.floor(1000 * part / whole) / 10:5.1f}%" if whole else "-"


def _category_table(by_cat: dict[str, list[dict[str, Any]]], results: list[dict[str, Any]]) -> None:
    head = ("category", "n", "compiled", "p50 ms", "valid acc.", "invalid rej.",
            "finished valid", "hit limit", "ff share")  # fmt: skip
    print(f"{head[0]:<16} {head[1]:>4} {head[2]:>13} {head[3]:>7} {head[4]:>13} {head[5]:>13} "
          f"{head[6]:>15} {head[7]:>12} {head[8]:>8}")  # fmt: skip
    for cat, rs in [*sorted(by_cat.items()), ("ALL", results)]:
        t = totals(rs)
        print(
            f"{cat:<16} {t['schemas']:>4} {_cell(t['compiled'], t['schemas']):>13} "
            f"{_fmt(_compile_ms(rs, 50), '.1f'):>7} "
            f"{_cell(t['valid_accepted'], t['valid_tests']):>13} "
            f"{_cell(t['invalid_rejected'], t['invalid_tests']):>13} "
            f"{_cell(t['finished_valid'], t['finished']):>15} "
            f"{_cell(t['hit_limit'], t['generated']):>12} "
            f"{_fmt(_ff_share(rs), '.0%'):>8}"
        )


def _glaive_comparison(glaive: list[dict[str, Any]]) -> None:
    t = totals(glaive)
    published = ", ".join(f"{k} {v:.2f}" for k, v in PUBLISHED_GLAIVE.items())
    declared = t["compiled"] / t["schemas"]
    line = f"GlaiveAI ({t['schemas']} schemas): declared coverage {declared:.2f}"
    if t["generated"]:
        compliance = t["finished_valid"] / t["compiled"] if t["compiled"] else 0.0
        line += (
            f", compliance {compliance:.2f}, empirical coverage "
            f"{t['finished_valid'] / t['schemas']:.2f}"
        )
    print(line)
    print(f"  published (JSONSchemaBench paper, as quoted in issue 5): {published}")
    if t["schemas"] < 100:
        print(f"  (a sample of {t['schemas']}: +-{100 / t['schemas'] ** 0.5:.0f} points; "
              "--category Glaiveai2K --per-category 200 for a closer comparison)")  # fmt: skip


def _compile_ms(results: Sequence[dict[str, Any]], q: float) -> float | None:
    times = [r["compile_s"] for r in results if r["compiled"]]
    return float(np.percentile(times, q) * 1e3) if times else None


def _ff_share(results: Sequence[dict[str, Any]]) -> float | None:
    gen = [r for r in results if r["finish"] is not None]
    total = sum(r["new_tokens"] for r in gen)
    return sum(r.get("forced_tokens", 0) for r in gen) / total if total else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def engine_table(report: dict[str, Any]) -> None:
    """One line per engine, on the same schemas: the issue's summary numbers."""
    print("\nengine      compiled          compile p50/p90 ms  valid accepted     "
          "invalid rejected   fill mean/p99 us  finished valid  hit limit  ff share")  # fmt: skip
    for engine in report.get("engines") or []:
        rows = [r for r in report["results"] if r.get("engine") == engine]
        t = totals(rows)
        fill = (report.get("mask_fill") or {}).get(engine) or {}
        p50, p90 = _compile_ms(rows, 50), _compile_ms(rows, 90)
        print(
            f"{engine:<11} {_cell(t['compiled'], t['schemas']):<17} "
            f"{_fmt(p50, '.1f'):>7}/{_fmt(p90, '.1f'):<10} "
            f"{_cell(t['valid_accepted'], t['valid_tests']):<18} "
            f"{_cell(t['invalid_rejected'], t['invalid_tests']):<18} "
            f"{_fmt(fill.get('mean_us'), '.0f'):>6}/{_fmt(fill.get('p99_us'), '.0f'):<9} "
            f"{_cell(t['finished_valid'], t['finished']):<15} "
            f"{_cell(t['hit_limit'], t['generated']):<10} {_fmt(_ff_share(rows), '.1%')}"
        )


def print_report(report: dict[str, Any]) -> None:
    """The report of each engine in turn (outputs: the first engine's), then the comparison."""
    engines = report.get("engines") or [None]
    for engine in engines:
        rows = [r for r in report["results"] if engine is None or r.get("engine") == engine]
        print(f"\n===== engine {engine}" if engine else "")
        _print_engine(report, rows, engine, first=engine == engines[0])
    if report.get("engines"):
        engine_table(report)


def _print_engine(
    report: dict[str, Any], results: list[dict[str, Any]], engine: str | None, *, first: bool
) -> None:
    print(f"model {report['model']}; greedy, up to {report['max_new_tokens']} new tokens, "
          f"batch {report['batch']}, compile limit {report['compile_timeout_s']:g} s")  # fmt: skip
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_cat[r["category"]].append(r)
    _category_table(by_cat, results)
    t = totals(results)
    print(f"\ndeclared coverage     {_rate(t['compiled'], t['schemas'])} compile within the limit")
    p50, p90 = _compile_ms(results, 50), _compile_ms(results, 90)
    print(f"compile time          p50 {_fmt(p50, '.1f')} ms, p90 {_fmt(p90, '.1f')} ms")
    used: dict[str, int] = defaultdict(int)
    for r in results:
        if r["compiled"]:
            used[r.get("engine_used") or "outlines"] += 1
    print("  compiled by         " + ", ".join(f"{e} {n}" for e, n in sorted(used.items())))
    warned = [r for r in results if r.get("notes")]
    print(f"  narrowing warnings  {len(warned)} schemas (each reported, see notes in --json)")
    fill = (report.get("mask_fill") or {}).get(engine) or {}
    if fill:
        walks = report.get("mask_walks", 1)
        best = f", each the best of {walks} walks" if walks > 1 else ""
        print(f"mask fill (engine)    mean {fill['mean_us']:.1f} us, p99 {fill['p99_us']:.1f} us "
              f"over {fill['steps']} steps of valid instances{best}")  # fmt: skip
    causes: dict[str, list[str]] = defaultdict(list)
    for r in results:
        if not r["compiled"]:
            causes[r["error_kind"] or "other"].append(r["name"])
    for cause, names in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        print(f"  GrammarError: {cause:<30} {len(names):>3}  e.g. {names[0]}")
    agree = t["valid_accepted"] + t["invalid_rejected"]
    print(f"regex soundness       invalid instances rejected "
          f"{_rate(t['invalid_rejected'], t['invalid_tests'])}")  # fmt: skip
    print(f"  completeness        valid instances accepted "
          f"{_rate(t['valid_accepted'], t['valid_tests'])}")  # fmt: skip
    print(f"  agreement           {_rate(agree, t['valid_tests'] + t['invalid_tests'])}")
    unsound = [r["name"] for r in results if r["invalid_rejected"] < r["invalid_tests"]]
    for name in unsound[:10]:
        print(f"  UNSOUND {name}: an invalid instance was accepted")
    if t["generated"]:
        print(f"finished outputs      parse and validate "
              f"{_rate(t['finished_valid'], t['finished'])} (must be 100%)")  # fmt: skip
        print(f"hit the token limit   {_rate(t['hit_limit'], t['generated'])} (goal < 5%)")
        print(f"  steered to finish   {_rate(t['steered'], t['generated'])} "
              "(the budget closed the document before the limit)")  # fmt: skip
        print(f"compliance            {_rate(t['finished_valid'], t['compiled'])} of compiled")
        print(f"empirical coverage    {_rate(t['finished_valid'], t['schemas'])} of all")
        for r in results:
            if r["finish"] == "stop" and not r["output_ok"]:
                print(f"  INVALID {r['name']}: {r['output_error']}")
    if by_cat.get("Glaiveai2K"):
        _glaive_comparison(by_cat["Glaiveai2K"])
    recompile = report.get("recompile") or {}
    if recompile:
        print(
            f"cached recompile      median {recompile['median_s'] * 1e3:.0f} ms, p90 "
            f"{recompile['p90_s'] * 1e3:.0f} ms, max {recompile['max_s'] * 1e3:.0f} ms; "
            f"{recompile['under_100ms']}/{recompile['n']} under 0.1 s"
        )
    share = _ff_share(results)
    if share is not None:
        print(f"fast-forward          {share:.1%} of output tokens fed without sampling")
        compared = [r for r in results if r.get("ff_identical") is not None]
        if compared:
            same = sum(bool(r["ff_identical"]) for r in compared)
            on = [r["tok_s"] for r in compared if r.get("tok_s")]
            off = [r["tok_s_no_ff"] for r in compared if r.get("tok_s_no_ff")]
            print(f"  token-identical     {_rate(same, len(compared))} with vs without")
            if on and off:
                print(f"  decode tok/s        mean {np.mean(on):.1f} with, {np.mean(off):.1f} "
                      "without")  # fmt: skip
    mask = report.get("mask") or {}
    if mask and first:
        print(
            f"mask per decode step  mean {mask['mean_us']:.0f} us, p99 {mask['p99_us']:.0f} us "
            f"over {mask['steps']} steps = {mask['share']:.2%} of the step "
            f"(mean step {mask['step_mean_ms']:.1f} ms at batch {report['batch']})"
        )
