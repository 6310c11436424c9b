"""Does a grammar accept a given text? The oracle for soundness checks.

Two ways to ask:

- `accepts_tokens`: walk a token sequence (e.g. the model tokenizer's encoding of a JSON
  document) through a Guide of the real index, exactly as generation would, and require an
  accepting state at the end;
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
from collections.abc import Sequence
from functools import lru_cache

from quantkit.grammar.compiler import CompiledGrammar
from quantkit.grammar.vocabulary import import_outlines_core

__all__ = ["accepts_text", "accepts_tokens"]


def accepts_tokens(compiled: CompiledGrammar, tokens: Sequence[int]) -> bool:
    """Whether the tokens are allowed one after another and end in an accepting state."""
    guide = import_outlines_core().Guide(compiled.index)
    try:
        for token in tokens:
            guide.advance(int(token), return_tokens=False)
    except ValueError:
        return False
    return bool(guide.is_finished())


@lru_cache(maxsize=64)
def _compiled(regex: str) -> re.Pattern[str]:
    return re.compile(regex)


def accepts_text(regex: str, text: str) -> bool:
    """Whether `regex` (a Grammar's regex) matches all of `text`."""
    return _compiled(regex).fullmatch(text) is not None
