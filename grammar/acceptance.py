"""Does a grammar accept a given text? The oracle for soundness checks.

Two ways to ask:

- `accepts_tokens`: walk a token sequence (e.g. the model tokenizer's encoding of a JSON
  document) through a row of the compiled grammar (either engine), exactly as generation
  would, and require an accepting state at the end;
- `accepts_text`: does the regex itself match the whole text (Python's `re`, which reads the
  syntax quantkit emits). The language of an index is a subset of its regex's: outlines-core
  0.2.14 drops the transitions from an accepting state into a non-accepting one (over single
  bytes, `a(bc)?` cannot go on after "a"; multi-byte tokens usually jump over the gap), and
  never adds any. So "the regex rejects every invalid instance" is the stronger soundness
  claim, and it does not depend on a tokenizer. (Checking with an index over 256 single bytes
  instead hits that pruning, and appending a terminator byte to avoid it made outlines-core's
  index construction run for minutes.)
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from quantkit.grammar.compiler import CompiledGrammar

__all__ = ["accepts_text", "accepts_tokens", "timed_walk"]


def accepts_tokens(compiled: CompiledGrammar, tokens: Sequence[int]) -> bool:
    """Whether the tokens are allowed one after another and end in an accepting state."""
    row = compiled.new_row()
    return all(row.advance(int(token)) for token in tokens) and row.is_finished()


def timed_walk(
    compiled: CompiledGrammar, tokens: Sequence[int], times_s: list[float], *, walks: int = 1
) -> bool:
    """`accepts_tokens`, filling the engine's allowed-token bitmask before every step and
    appending each fill's time to `times_s` (the mask cost alone, as a decode step pays it).
    walks > 1: the document is walked that many times, each in a new row of `compiled`, and
    each step's time is the best of them (the cost without the noise of a shared machine, and
    with what the rows of one grammar share already built, as for the next request)."""
    best: list[float] = []
    accepted = False
    line = np.zeros((compiled.vocabulary.size + 31) // 32, dtype=np.int32)
    for walk in range(walks):
        row = compiled.new_row()
        times: list[float] = []
        ok = True
        for token in tokens:
            started = time.perf_counter()
            row.fill(line)
            times.append(time.perf_counter() - started)
            if not row.advance(int(token)):
                ok = False
                break
        best = times if walk == 0 else [min(a, b) for a, b in zip(best, times, strict=True)]
        accepted = ok and row.is_finished()
    times_s.extend(best)
    return accepted


@lru_cache(maxsize=64)
def _compiled(regex: str) -> re.Pattern[str]:
    return re.compile(regex)


def accepts_text(regex: str, text: str) -> bool:
    """Whether `regex` (a Grammar's regex) matches all of `text`."""
    return _compiled(regex).fullmatch(text) is not None
