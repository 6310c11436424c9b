"""The keys' forced texts tokenized when a JSON schema compiles (`llguidance.warm`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from quantkit.grammar.llguidance import warm
from quantkit.grammar.llguidance.engine import _greedy_encoder
from tests.hand_vocab import llguidance, vocab_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        'say "hi"': {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"id": {}}}},
        "kind": {"enum": [{"properties": {"not_a_name": 1}}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_forced_texts_name_each_key_with_every_value_opening() -> None:
    texts = warm.forced_texts(SCHEMA)
    for common in ('{"', '":"', '"', '","'):
        assert common in texts
    for key in ('name":', 'age":', 'say \\"hi\\"":', 'tags":', 'id":', 'kind":'):
        for lead in ("", ',"', '","'):
            assert [lead + key + o for o in ('"', "[", "{", "")] == [
                t for t in texts if t.startswith(lead + key)
            ], (lead, key)
    assert not any("not_a_name" in t for t in texts)  # enum values are data, not schemas


def test_a_name_is_written_as_llguidance_forces_it() -> None:
    """A name outside ASCII as its UTF-8 (llguidance forces `{"é":`, never `\\u00e9`), an
    escaped one with JSON's escapes."""
    texts = warm.forced_texts({"properties": {"é": {}, 'q"x': {}}})
    assert 'é":' in texts and 'q\\"x":' in texts
    assert not any("\\u" in t for t in texts)
    vocab = vocab_of(list('{}":,0123456789') + ["é".encode()])
    schema = {"type": "object", "properties": {"é": {"type": "integer"}}, "required": ["é"]}
    row = llguidance(schema, vocab)
    forced = bytes(row.new_row().row.matcher.compute_ff_bytes())
    assert forced == b'{"' + warm.json_name("é").encode() + b'":'


def test_forced_texts_stop_at_max_names() -> None:
    schema = {"properties": {f"p{i}": {} for i in range(warm.MAX_NAMES + 10)}}
    keys = [t for t in warm.forced_texts(schema) if t.startswith("p") and t.endswith('":"')]
    assert len(keys) == warm.MAX_NAMES
    assert warm.warm_keys(schema, None) == 0  # no encoder: nothing to remember


def test_compile_tokenizes_the_keys_before_the_steps_ask() -> None:
    """The texts a row's fast-forward asks the tokenizer for at a key were tokenized by the
    compile already (so the encoder remembers them), and the forced tokens are the same."""
    pieces = [
        '{"',
        "{",
        "}",
        '"',
        ":",
        ",",
        '":"',
        '":',
        '","',
        ',"',
        "name",
        "age",
        "na",
        "me",
        "a",
        "b",
        "1",
        "2",
        "ag",
        "e",
        "tags",
        "[",
        "]",
        "id",
        "x",
        "warm-only",
    ]
    vocab = vocab_of(pieces)
    greedy = _greedy_encoder(vocab)
    asked: list[bytes] = []

    def encode(data: bytes) -> list[int]:
        asked.append(bytes(data))
        return greedy(data)

    vocab = dataclasses.replace(vocab, encode=encode)
    compiled = llguidance(SCHEMA, vocab)
    at_compile = set(asked)
    assert {t.encode() for t in warm.forced_texts(SCHEMA)} <= at_compile
    # walk a document, asking for the forced tokens after every token as generate does
    del asked[:]
    row = compiled.new_row()
    text = json.dumps({"name": "ab", "age": 12}, separators=(",", ":")).encode()
    forced = []
    for token in greedy(text):
        assert row.advance(token)
        forced += row.forced_tokens()
    keys = [t for t in asked if b'":' in t]
    assert keys and forced, asked  # the walk met forced keys
    assert set(keys) <= at_compile


def test_a_rows_first_mask_is_the_compiles_and_then_its_own() -> None:
    """The compile makes the start state's mask; a row's first fill copies it (the matcher's
    own mask there, bit for bit, also with a verdict's token held), and once the row advances
    its fills are its matcher's again."""
    vocab = vocab_of(list('{}[]":,abcdefghijklmnopqrstuvwxyz0123456789'))
    compiled = llguidance(SCHEMA, vocab)
    row = compiled.new_row().row
    start = compiled.index.start_mask
    assert start is not None and start.any()
    own = np.zeros_like(start)
    row.matcher.unsafe_compute_mask_ptr(own.ctypes.data, own.nbytes)
    assert np.array_equal(own, start)
    brace = next(t for t, d in vocab.token_bytes.items() if d == b"{")
    assert row.matcher.try_consume_tokens([brace]) == 1
    row.tried = brace  # held, as a verdict holds the token it allowed
    line = np.full_like(start, -1)
    row.fill(line)
    assert np.array_equal(line, start) and row.tried is None
    assert row.advance(brace)
    row.fill(line)
    own = np.zeros_like(start)
    row.matcher.unsafe_compute_mask_ptr(own.ctypes.data, own.nbytes)
    assert np.array_equal(line, own) and not np.array_equal(line, start)
