"""Finishing within the token budget: how far each grammar state is from an accepting one.

A greedy small model can loop inside an unbounded string ("/type/type/type...") or number
("1000000...") until `max_new_tokens` runs out, leaving an unfinished document. Bounding every
string in the grammar would make the index far larger (see `outlines.schema_regex.regex_parts`), so
instead the processor watches the budget: once the tokens left come within `WINDOW` of the bytes
that completing the document needs, it allows only tokens after which completion still fits (a
token's bytes are walked through the plan; in free text only single-byte tokens are tried), and when
nothing fits any more, only the tokens that get closest to completion.

The distances come from a second index of the same regex over the 256 single bytes: its states
are the same automaton states as the token index's (the same regex gives the same DFA; checked
in the tests), it compiles in a fraction of the time, and its transitions are few enough to
read into Python. dist[state] = the fewest bytes from `state` to an accepting state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cache

from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["WINDOW", "CompletionPlan", "byte_vocabulary", "completion_plan"]

# How many tokens of slack before the budget starts to steer. Inside the window the model
# writes byte by byte (worse text), so it is small; outside it nothing is checked, so one
# ordinary token that raises the distance by more than this right at the window's edge (opening
# an object with many required properties) can still miss the budget. Best effort, not a proof.
WINDOW = 16
BYTE_EOS = 256


@cache
def byte_vocabulary() -> TokenVocabulary:
    """Token i = byte i (0..255), EOS = 256."""
    return TokenVocabulary.from_bytes(
        {b: bytes([b]) for b in range(256)}, eos_token_ids=[BYTE_EOS], size=BYTE_EOS + 1
    )


@dataclass(frozen=True)
class CompletionPlan:
    """dist: state -> fewest bytes to an accepting state (missing: cannot complete).
    step: state -> {byte: next state}."""

    dist: dict[int, int]
    step: dict[int, dict[int, int]]

    def after(self, state: int, data: bytes) -> int | None:
        """The distance left after writing `data` from `state` (None: not allowed)."""
        for byte in data:
            nxt = self.step.get(state, {}).get(byte)
            if nxt is None:
                return None
            state = nxt
        return self.dist.get(state)


def completion_plan(byte_index: object) -> CompletionPlan:
    """Distances by a backward breadth-first search from the accepting states of an index over
    `byte_vocabulary()` (its transitions as outlines-core returns them)."""
    transitions: dict[int, dict[int, int]] = byte_index.get_transitions()  # type: ignore[attr-defined]
    step = {
        s: {b: n for b, n in edges.items() if b != BYTE_EOS} for s, edges in transitions.items()
    }
    back: dict[int, list[int]] = {}
    for state, edges in step.items():
        for nxt in edges.values():
            back.setdefault(nxt, []).append(state)
    dist = {s: 0 for s in byte_index.get_final_states()}  # type: ignore[attr-defined]
    queue = deque(dist)
    while queue:
        state = queue.popleft()
        for prev in back.get(state, ()):
            if prev not in dist:
                dist[prev] = dist[state] + 1
                queue.append(prev)
    return CompletionPlan(dist=dist, step=step)
