"""Hand-made vocabularies for grammar tests: each piece one token, and a JSON value walked
through a compiled grammar as the greedy longest-match encoding of its compact text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from quantkit.grammar.acceptance import accepts_tokens
from quantkit.grammar.compiler import CompiledGrammar, compile_grammar
from quantkit.grammar.constraints import schema_grammar, validate_json
from quantkit.grammar.llguidance.engine import _greedy_encoder
from quantkit.grammar.vocabulary import TokenVocabulary

EOS = (0,)


def vocab_of(pieces: Sequence[str | bytes]) -> TokenVocabulary:
    """Token i + 1 is pieces[i]; token 0 is EOS; a few ids past the pieces hold nothing."""
    table = {i + 1: p if isinstance(p, bytes) else p.encode() for i, p in enumerate(pieces)}
    return TokenVocabulary.from_bytes(table, eos_token_ids=EOS, size=len(pieces) + 9)


def accepts(compiled: CompiledGrammar, value: object) -> bool:
    """Whether the grammar accepts `value`'s compact JSON, walked token by token."""
    text = json.dumps(value, separators=(",", ":")).encode()
    return accepts_tokens(compiled, _greedy_encoder(compiled.vocabulary)(text))


def llguidance(schema: object, vocab: TokenVocabulary) -> CompiledGrammar:
    """`schema` compiled by llguidance (with every rewrite the engine makes) for `vocab`."""
    return compile_grammar(schema_grammar(schema), vocab, engine="llguidance", timeout_s=10)


def fed_row(vocab: TokenVocabulary, schema: object, text: str) -> Any:
    """A row of `schema` compiled by llguidance, advanced through `text` one single-byte token
    a byte."""
    row = llguidance(schema, vocab).new_row()
    by_byte = {data: t for t, data in vocab.token_bytes.items() if len(data) == 1}
    for byte in text.encode():
        assert row.advance(by_byte[bytes([byte])]), (text, chr(byte))
    return row


def agrees(compiled: CompiledGrammar, schema: object, valid: Sequence[object],
           invalid: Sequence[object]) -> None:  # fmt: skip
    """The instances are what jsonschema says they are, and the compiled grammar agrees: every
    valid one accepted, every invalid one rejected."""
    for value in valid:
        assert validate_json(json.dumps(value), schema) is None, value
        assert accepts(compiled, value), value
    for value in invalid:
        assert validate_json(json.dumps(value), schema) is not None, value
        assert not accepts(compiled, value), value
