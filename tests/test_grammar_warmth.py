"""The grammar step's warm and swept replays (`evals.grammar.warmth`): a recorded greedy decode
(kept best tokens, fast-forward) replays to the same picks and forced tokens on a new processor,
with and without a read before each call; a replay that would differ is one error; and one run on
the embedded model reports the three step times."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from quantkit.errors import EvalError
from quantkit.evals.grammar.warmth import Call, Forced, main, recorder, replay, step_times
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.runtime.kept_argmax import keep
from tests.hand_vocab import EOS, vocab_of
from tests.hand_vocab import llguidance as llg

pytestmark = pytest.mark.usefixtures("grammar_home")

PIECES = [*'{}[]":,abcdefghijklmnopqrstuvwxyz0123456789.-', '"a":', '{"', "ab", '"name":"',
          "true", " "]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "name": {"type": "string"}},
          "required": ["a", "name"]}  # fmt: skip


def _decode(processor: Any, size: int, seed: int, steps: int = 40) -> list[int]:
    """Greedy decoding of a random 'model' as the decode loop drives a processor: the head's
    best tokens kept with each step's logits, the pick fed to `forced_tokens` (fast-forward)
    and the forced tokens appended to the ids."""
    rng = np.random.default_rng(seed)
    ids, out = torch.zeros((1, 1), dtype=torch.long), []
    for _ in range(steps):
        scores = torch.from_numpy(rng.normal(size=size)).float()
        logits = scores[None]
        order = np.argsort(-scores.numpy(), kind="stable")[:8].astype(np.int64)
        keep(logits, torch.from_numpy(order)[None])
        token = int(processor(ids, logits).argmax())
        if token in EOS:
            break
        forced = processor.forced_tokens(0, token, limit=8)
        out += [token, *forced]
        ids = torch.cat([ids, torch.tensor([[token, *forced]])], 1)
    return out


def _recorded(seed: int) -> tuple[Any, dict[str, Any]]:
    vocab = vocab_of(PIECES)
    kwargs = {"grammars": [llg(SCHEMA, vocab)], "max_new_tokens": 40, "greedy": True}
    live = recorder(**kwargs)
    _decode(live, vocab.size, seed)
    return live, kwargs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_recorded_decode_replays_warm_and_swept(seed: int) -> None:
    live, kwargs = _recorded(seed)
    calls = [e for e in live.events if isinstance(e, Call)]
    assert len(calls) >= 3 and any(isinstance(e, Forced) for e in live.events)
    assert all(c.best is not None for c in calls)  # the kept tokens went with the logits
    sweep = np.ones(1 << 16, dtype=np.uint8)
    for given in (None, sweep):
        processor = GrammarLogitsProcessor(**kwargs)
        times = replay(live.events, processor, given)
        assert len(times) == len(step_times(live)) == len(calls) - 1
        assert processor.token_count == live.token_count


def test_a_replay_that_differs_is_one_error() -> None:
    live, kwargs = _recorded(0)
    events = list(live.events)
    at = next(i for i, e in enumerate(events) if isinstance(e, Call) and i > 0)
    call = events[at]
    assert isinstance(call, Call)
    events[at] = replace(call, picks=[call.picks[0] + 1])
    with pytest.raises(EvalError, match=rf"replay, call {at}: expected picks"):
        replay(events, GrammarLogitsProcessor(**kwargs), None)
    events = list(live.events)
    at = next(i for i, e in enumerate(events) if isinstance(e, Forced))
    forced = events[at]
    assert isinstance(forced, Forced)
    events[at] = replace(forced, tokens=[*forced.tokens, 1])
    with pytest.raises(EvalError, match=rf"replay, call {at}: expected forced tokens"):
        replay(events, GrammarLogitsProcessor(**kwargs), None)


def test_bad_arguments_are_one_error() -> None:
    with pytest.raises(EvalError, match="expected --per-category, --max-new-tokens, --rounds"):
        main(["--rounds", "0"])
    with pytest.raises(EvalError, match="and --sweep-mb >= 1, got 2, 512, 3 and 0"):
        main(["--sweep-mb", "0"])


@pytest.mark.slow
def test_a_run_on_the_demo_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], session_home: None
) -> None:
    """The demo's schema, a few tokens: the live, warm and swept steps each have a time, and the
    table prints the three lines. The real model from the shared cache."""
    schema = Path(__file__).resolve().parents[1] / "examples" / "person.json"
    report = tmp_path / "warmth.json"
    code = main(["--schema", str(schema), "--max-new-tokens", "16", "--rounds", "1",
                 "--sweep-mb", "4", "--model", "smollm2-135m", "--json", str(report)])  # fmt: skip
    data = json.loads(report.read_text())
    assert code == 0 and data["schemas"] == 1 and data["steps"] > 0
    for key in ("live", "warm", "swept"):
        assert data[key]["mean_us"] > 0 and data[key]["median_us"] > 0
    out = capsys.readouterr().out
    assert "live (generate)" in out and "replayed warm" in out and "4 MB read first" in out
