"""Lark grammars (llguidance's dialect) without a model: is the syntax right (`check_syntax`,
run before the model loads, so a typo costs milliseconds, not a model load), and is a text in
the grammar's language (`text_accepted`)?

`text_accepted` builds a new matcher from the grammar text over a vocabulary of the 256 single
bytes, so it shares neither the model's tokenizer nor any state with the matcher that
constrained the output: it checks a finished output again, as the regex check does for
`--regex` (Python's `re`, not outlines-core's index).
"""

from __future__ import annotations

from functools import cache

from quantkit.errors import GrammarError
from quantkit.grammar.llguidance.engine import error_line, import_llguidance, llg_tokenizer
from quantkit.grammar.vocabulary import TokenVocabulary

__all__ = ["byte_vocabulary", "check_syntax", "text_accepted"]

# llguidance's warning when a grammar names a token (<[id]>) and no tokenizer is given: the
# compile, which has the model's tokenizer, checks those.
_NO_TOKENIZER = "no tokenizer"


def check_syntax(lark: str) -> tuple[str | None, list[str]]:
    """(why llguidance cannot read `lark`, as one line, or None; its warnings). Needs no
    tokenizer; native code that may take seconds on a huge grammar: run it under a limit."""
    llg = import_llguidance()
    text = llg.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, None)
    if is_error:
        return error_line(messages), []
    return None, [m for m in messages if _NO_TOKENIZER not in m]


@cache
def byte_vocabulary() -> TokenVocabulary:
    """Token b + 1 is the byte b; token 0 is EOS."""
    table = {b + 1: bytes([b]) for b in range(256)}
    return TokenVocabulary.from_bytes(table, eos_token_ids=[0], size=257)


def text_accepted(lark: str, data: bytes) -> bool:
    """Whether the grammar `lark` derives exactly `data`: a new matcher (see the module
    docstring) fed one byte a token, in an accepting state at the end."""
    llg = import_llguidance()
    tokenizer = llg_tokenizer(byte_vocabulary())
    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    if matcher.is_error():
        raise GrammarError(f"llguidance cannot compile the grammar: {matcher.get_error()}")
    return bool(matcher.consume_tokens([b + 1 for b in data])) and bool(matcher.is_accepting())
