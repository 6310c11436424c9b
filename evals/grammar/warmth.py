"""How much of a grammar step inside `generate` is the cache the model's step leaves cold.

A CPU decode step streams the model's weights through every cache (about 100 MB a token for
the embedded INT4 model, against a last-level cache of 32 MB or so), so the grammar's step that
follows finds its state (llguidance's, the processor's, the interpreter's own) in memory, not in
cache. This tells the two apart: each greedy generation (the JSONSchemaBench sample, or
`--schema` files, on the embedded INT4 model) runs once with its processor's calls recorded
(input ids, logits, the head's kept best tokens, the fast-forward calls), and the calls are
replayed on a new processor `--rounds` times in two ways, alternating:

- warm: call after call, nothing between (where the model's weights do not pass through the
  CPU's caches: a GPU's, or a model smaller than the cache);
- swept: a read of `--sweep-mb` MB before each call, as a CPU decode step does.

Every replayed call must give what the live one gave (each row's arg-max of the returned logits,
the forced tokens), else EvalError: the same work, only the caches differ. The live step is
what `generate` reports (`mask_times_s`, the advances after sampling included, each
generation's first call, the row's setup, left out) of the second of two generations of each
schema, the one recorded.

Usage: python -m quantkit.evals.grammar.warmth [--data DIR] [--per-category K]
           [--schema FILE ...] [--max-new-tokens N] [--rounds R] [--sweep-mb MB] [--json F]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from quantkit.errors import EvalError
from quantkit.evals.common import git_commit, print_and_save, run_main
from quantkit.evals.grammar.data import add_schema_arguments, schemas_asked
from quantkit.evals.grammar.generate import load_model, model_vocabulary, schema_jobs

__all__ = ["Call", "Forced", "main", "recorder", "replay", "step_times"]


@dataclass(frozen=True)
class Call:
    """One processor call as the decode loop made it, and the rows' picks it led to."""

    input_ids: Any  # torch.Tensor [B, T]
    logits: Any  # torch.Tensor [B, V], a copy
    best: list[list[int]] | None  # the head's kept best tokens for them (`kept_best`)
    picks: list[int]  # each row's arg-max of what the call returned


@dataclass(frozen=True)
class Forced:
    """One `forced_tokens` call (fast-forward after sampling) and what it returned."""

    row: int
    token: int
    limit: int
    tokens: list[int]


def recorder(**kwargs: Any) -> Any:
    """A `GrammarLogitsProcessor(**kwargs)` that keeps its calls in `events` (`Call`,
    `Forced`), each read after the call so that its own timing is untouched."""
    from quantkit.grammar.processor import GrammarLogitsProcessor
    from quantkit.runtime.kept_argmax import held, kept_best

    class Recorder(GrammarLogitsProcessor):
        def __init__(self) -> None:
            super().__init__(**kwargs)
            self.events: list[Call | Forced] = []

        def __call__(self, input_ids: Any, logits: Any) -> Any:
            before = held()  # a one-hot pick keeps its own: read the head's after the call
            out = super().__call__(input_ids, logits)
            best = kept_best(logits, at=before)  # the processor wrote nothing into them
            picks = out.argmax(dim=-1).tolist()
            self.events.append(Call(input_ids.clone(), logits.clone(), best, picks))
            return out

        def forced_tokens(self, row: int, token: int, *, limit: int) -> list[int]:
            tokens = super().forced_tokens(row, token, limit=limit)
            self.events.append(Forced(row, token, limit, list(tokens)))
            return tokens

    return Recorder()


def step_times(processor: Any) -> list[float]:
    """A processor's step times as `generate` reports them: each call after the first (the
    row's setup), the advance after the last step added to the last."""
    times = [float(t) for t in processor.mask_times_s[1:]]
    if times:
        times[-1] += processor._between_s
    return times


def replay(events: list[Call | Forced], processor: Any, sweep: np.ndarray | None) -> list[float]:
    """The recorded calls made again on `processor` (new, built as the recorded one was), a read
    of all of `sweep` before each call where given; its step times. EvalError where a call
    gives other picks or other forced tokens than recorded."""
    import torch

    from quantkit.runtime.kept_argmax import keep

    for i, event in enumerate(events):
        if isinstance(event, Forced):
            tokens = processor.forced_tokens(event.row, event.token, limit=event.limit)
            if list(tokens) != event.tokens:
                raise EvalError(
                    f"replay, call {i}: expected forced tokens {event.tokens}, got {tokens}"
                )
            continue
        logits = event.logits.clone()
        if event.best is not None:
            keep(logits, torch.tensor(event.best, dtype=torch.int64))
        if sweep is not None:
            sweep.max()  # every line of it read: the caches now hold the sweep
        picks = processor(event.input_ids, logits).argmax(dim=-1).tolist()
        if picks != event.picks:
            raise EvalError(f"replay, call {i}: expected picks {event.picks}, got {picks}")
    return step_times(processor)


def _stats(times: list[float]) -> dict[str, float]:
    arr = np.asarray(times) * 1e6
    return {"mean_us": float(arr.mean()), "median_us": float(np.median(arr)),
            "p90_us": float(np.percentile(arr, 90))}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    schemas = schemas_asked(args)
    loaded, desc = load_model(args.model)
    eos, vocab = model_vocabulary(loaded)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    jobs, skipped = schema_jobs(loaded, schemas, vocab)
    sweep = np.ones(args.sweep_mb << 20, dtype=np.uint8)
    live: list[float] = []
    warm: list[float] = []
    swept: list[float] = []
    for compiled, prompt in jobs:
        kwargs = {"grammars": [compiled], "max_new_tokens": args.max_new_tokens, "greedy": True}
        # The second generation is the one recorded: a grammar's first pays for what its
        # later ones share (the process's first generation ran at twice the step time).
        for live_processor in (_processor(kwargs), recorder(**kwargs)):
            generate(loaded.model, [prompt], params, processors=[live_processor], eos_ids=eos,
                     tokenizer=loaded.tokenizer, fast_forward=True)  # fmt: skip
        live += step_times(live_processor)
        events = live_processor.events
        for _ in range(args.rounds):
            warm += replay(events, _processor(kwargs), None)
            swept += replay(events, _processor(kwargs), sweep)
    if not live:
        raise EvalError("expected generations of at least two steps, got none")
    return {
        "commit": git_commit(), "model": desc, "schemas": len(jobs), "skipped": skipped,
        "steps": len(live), "rounds": args.rounds, "sweep_mb": args.sweep_mb,
        "live": _stats(live), "warm": _stats(warm), "swept": _stats(swept),
    }  # fmt: skip


def _processor(kwargs: dict[str, Any]) -> Any:
    from quantkit.grammar.processor import GrammarLogitsProcessor

    return GrammarLogitsProcessor(**kwargs)


def table(report: dict[str, Any]) -> str:
    lines = [
        f"grammar step inside generate, and its calls replayed ({report['commit']}): "
        f"{report['schemas']} schemas, {report['steps']} steps, {report['rounds']} rounds",
        "                            mean us  median us     p90 us",
    ]
    rows = (("live (generate)", "live"), ("replayed warm", "warm"),
            (f"replayed, {report['sweep_mb']} MB read first", "swept"))  # fmt: skip
    for label, key in rows:
        s = report[key]
        lines.append(f"{label:26s} {s['mean_us']:8.1f} {s['median_us']:10.1f} {s['p90_us']:10.1f}")
    if report["skipped"]:
        lines.append(f"skipped (not compiled): {len(report['skipped'])}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.warmth")
    add_schema_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sweep-mb", type=int, default=96, help="MB read before each swept call (a decode step)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.per_category, args.max_new_tokens, args.rounds, args.sweep_mb) < 1:
        raise EvalError(
            f"expected --per-category, --max-new-tokens, --rounds and --sweep-mb >= 1, got "
            f"{args.per_category}, {args.max_new_tokens}, {args.rounds} and {args.sweep_mb}"
        )
    report = run(args)
    print_and_save(report, table(report), args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
