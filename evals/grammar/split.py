"""Where a grammar step's time goes inside `generate`: each part's own time a decode step.

`paired` says whether a change made the grammar's step cheaper; this says what the step is made
of, so the next change goes where the time is. Greedy generations on the embedded INT4 model
(the JSONSchemaBench sample, or `--schema` files) run with timers around the parts of a step
(`PARTS`): llguidance's calls (the verdict's try, the forced bytes and tokens, the advance, the
mask), the JSON row's own checks (the text state it feeds, repeated keys and items, key
corners, the runaway curb), the budget steering, and what is left of the processor's call.
Each part's time is its own: a timed part called inside another counts for itself, not for
both, so the parts add up to the step (`mask_times_s`, the advances after sampling included).

Timers cost time too: each timed call adds its timer's own cost (measured here, ~0.4 us) to the
step, so the instrumented step is longer than a plain one; the report gives both means, the
plain one from a first pass without timers over the same schemas.

Usage: python -m quantkit.evals.grammar.split [--data DIR] [--per-category K]
           [--schema FILE ...] [--max-new-tokens N] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from quantkit.errors import EvalError
from quantkit.evals.common import git_commit, print_and_save, run_main
from quantkit.evals.grammar.data import add_schema_arguments, schemas_asked
from quantkit.evals.grammar.generate import load_model, model_vocabulary, schema_jobs

__all__ = ["PARTS", "main", "timed_parts"]

_G = "quantkit.grammar"
# (label, group, module, class, method): the parts of a step, each timed for its own time.
PARTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("verdict's try", "llguidance", f"{_G}.llguidance.engine", "LlgRow", "verdict"),
    ("forced bytes", "llguidance", f"{_G}.llguidance.engine", "LlgRow", "_forced_bytes"),
    ("forced tokens", "llguidance", f"{_G}.llguidance.engine", "LlgRow", "_forced_token_list"),
    ("advance", "llguidance", f"{_G}.llguidance.engine", "LlgRow", "advance"),
    ("byte check", "llguidance", f"{_G}.llguidance.engine", "LlgRow", "takes_byte"),
    ("mask", "llguidance", f"{_G}.llguidance.engine", "LlgRow", "fill"),
    ("text state", "JSON row", f"{_G}.llguidance.distinct_items", "DistinctItems", "feed"),
    ("repeat checks", "JSON row", f"{_G}.llguidance.distinct_items", "DistinctRow", "_checks"),
    ("repeat probes", "JSON row", f"{_G}.llguidance.distinct_items", "DistinctItems",
     "first_repeat"),
    ("key corners", "JSON row", f"{_G}.llguidance.key_corners", "KeyCorners", "clear_of"),
    ("key screen", "JSON row", f"{_G}.llguidance.key_corners", "KeyCorners", "screen"),
    ("runaway curb", "JSON row", f"{_G}.llguidance.distinct_items", "DistinctRow", "_curbed"),
    ("row's verdict", "JSON row", f"{_G}.llguidance.distinct_items", "DistinctRow", "verdict"),
    ("row's mask", "JSON row", f"{_G}.llguidance.distinct_items", "DistinctRow", "fill"),
    ("steering plan", "steering", f"{_G}.processor", "GrammarLogitsProcessor", "_walk_plan"),
    ("steered mask", "steering", f"{_G}.processor", "GrammarLogitsProcessor", "_steer_walk"),
    ("probe loop", "processor", f"{_G}.processor", "GrammarLogitsProcessor", "_probe"),
    ("pick", "processor", f"{_G}.processor", "GrammarLogitsProcessor", "_pick"),
    ("masked step", "processor", f"{_G}.processor", "GrammarLogitsProcessor", "_fill"),
    ("key screen call", "processor", f"{_G}.processor", "GrammarLogitsProcessor", "_screen"),
    ("after sampling", "processor", f"{_G}.processor", "GrammarLogitsProcessor", "_forced"),
    ("call itself", "processor", f"{_G}.processor", "GrammarLogitsProcessor", "__call__"),  # CALL
)  # fmt: skip
REST = ("untimed, and timers", "processor")
CALL = "call itself"  # the processor's call: its first (the row's setup) is left out


class _Clock:
    """Own time per label: a timed call's time less that of the timed calls inside it."""

    def __init__(self) -> None:
        self.own: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inner = [0.0]  # per open timed call: its timed callees' time so far
        self._drop: set[str] = set()  # labels whose next call's end is not counted

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        inner, own, calls, drop = self._inner, self.own, self.calls, self._drop

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                nested = inner.pop()
                inner[-1] += spent
                if label in drop:
                    drop.discard(label)
                else:
                    own[label] = own.get(label, 0.0) + spent - nested
                    calls[label] = calls.get(label, 0) + 1

        return timed

    def first_call_apart(self, processor: Any) -> Callable[[float], None]:
        """A replacement for `processor._timed` that leaves the processor's first call (the
        row's setup, which `mask_times_s[1:]` leaves out too) out of the parts' times: those
        inside it are put back to where they were, and the call's own end is not counted."""
        original, own, calls = processor._timed, self.own, self.calls
        before = (dict(own), dict(calls))

        def timed(started: float) -> None:
            original(started)
            if len(processor.mask_times_s) == 1:
                for label in list(own):
                    own[label] = before[0].get(label, 0.0)
                    calls[label] = before[1].get(label, 0)
                self._drop.add(CALL)

        return timed


@contextmanager
def timed_parts(clock: _Clock) -> Iterator[None]:
    """`PARTS` timed by `clock` for the duration (the methods put back after)."""
    saved = []
    try:
        for label, _, module, cls_name, method in PARTS:
            cls = getattr(importlib.import_module(module), cls_name)
            fn = cls.__dict__[method]
            saved.append((cls, method, fn))
            setattr(cls, method, clock.wrap(label, fn))
        yield
    finally:
        for cls, method, fn in reversed(saved):
            setattr(cls, method, fn)


def _timer_cost() -> float:
    """One timed call's own cost in seconds (an empty function, timed and not)."""

    def empty() -> None:
        return None

    clock = _Clock()
    wrapped = clock.wrap("empty", empty)
    n = 20000
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            wrapped()
        mid = time.perf_counter()
        for _ in range(n):
            empty()
        best = min(best, ((mid - start) - (time.perf_counter() - mid)) / n)
    return max(best, 0.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from quantkit.grammar.processor import GrammarLogitsProcessor
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    schemas = schemas_asked(args)
    loaded, desc = load_model(args.model)
    eos, vocab = model_vocabulary(loaded)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    jobs, skipped = schema_jobs(loaded, schemas, vocab)

    def steps(clock: _Clock | None = None) -> tuple[float, int]:
        """The processors' time over all generations (their setups left out, the advance
        after each generation's last step kept) and the steps counted."""
        total, n = 0.0, 0
        for compiled, prompt in jobs:
            processor = GrammarLogitsProcessor(
                [compiled], max_new_tokens=args.max_new_tokens, greedy=True
            )
            if clock is not None:
                processor._timed = clock.first_call_apart(processor)  # type: ignore[method-assign]
            generate(loaded.model, [prompt], params, processors=[processor], eos_ids=eos,
                     tokenizer=loaded.tokenizer, fast_forward=True)  # fmt: skip
            times = processor.mask_times_s[1:]  # the first call sets the row up
            total += float(np.sum(times)) + processor._between_s  # the last token's advance
            n += len(times)
        return total, n

    plain, _ = steps()
    clock = _Clock()
    with timed_parts(clock):
        total, n = steps(clock)
    if not n:
        raise EvalError("expected generations of at least two steps, got none")
    parts = {label: {"us_per_step": clock.own.get(label, 0.0) / n * 1e6,
                     "calls_per_step": clock.calls.get(label, 0) / n}
             for label, *_ in PARTS}  # fmt: skip
    rest = total / n * 1e6 - sum(p["us_per_step"] for p in parts.values())
    parts[REST[0]] = {"us_per_step": max(rest, 0.0), "calls_per_step": 1.0}
    return {
        "commit": git_commit(), "model": desc, "schemas": len(jobs), "skipped": skipped,
        "steps": n, "plain_mean_us": plain / n * 1e6,
        "timed_mean_us": total / n * 1e6, "timer_us": _timer_cost() * 1e6,
        "groups": {label: group for label, group, *_ in PARTS} | {REST[0]: REST[1]},
        "parts": parts,
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    timed = report["timed_mean_us"]
    lines = [
        f"grammar step inside generate ({report['commit']}), {report['schemas']} schemas, "
        f"{report['steps']} steps: mean {report['plain_mean_us']:.1f} us plain, "
        f"{timed:.1f} us timed ({report['timer_us']:.2f} us a timed call)",
        "group       part                   us/step   share  calls/step  us/call",
    ]
    by_group: dict[str, float] = {}
    for label, part in report["parts"].items():
        group = report["groups"][label]
        by_group[group] = by_group.get(group, 0.0) + part["us_per_step"]
        per_call = part["us_per_step"] / part["calls_per_step"] if part["calls_per_step"] else 0
        lines.append(f"{group:11s} {label:20s} {part['us_per_step']:9.1f} "
                     f"{part['us_per_step'] / timed:7.1%} {part['calls_per_step']:11.2f} "
                     f"{per_call:8.1f}")  # fmt: skip
    lines.append("by group: " + ", ".join(f"{g} {v:.1f} us ({v / timed:.0%})"
                                          for g, v in by_group.items()))  # fmt: skip
    if report["skipped"]:
        lines.append(f"skipped (not compiled): {len(report['skipped'])}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.split")
    add_schema_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.per_category < 1 or args.max_new_tokens < 1:
        raise EvalError(
            f"expected --per-category and --max-new-tokens >= 1, got {args.per_category} and "
            f"{args.max_new_tokens}"
        )
    report = run(args)
    print_and_save(report, table(report), args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
