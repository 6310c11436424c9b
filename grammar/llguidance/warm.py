"""The texts a JSON row's fast-forward will tokenize, tokenized once when the grammar compiles.

Where a JSON schema forces bytes (a key's name after its first letters, `":"` after a key),
llguidance asks the model's tokenizer for their canonical tokens (`compute_ff_tokens`, through
the vocabulary's `encode`, which remembers what it has tokenized). Inside `generate` each new
text costs 65-90 us: the decode step before it has pushed the tokenizer's code and tables out
of the caches (the same call costs ~8 us hot). On the demo schema 9 of the 42 steps met a text
for the first time; most were a property's key with its value's opening (`name":"`, `age":`,
`interests":[`, after a string value's end `","age":`), which the schema names in advance.
`warm_keys` tokenizes those when the grammar compiles, where a text costs the hot price and is
counted in the compile time, so that the steps find them remembered. The tokens are the same
either way: the encoder is a pure function of the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from quantkit.grammar.llguidance.schema import schema_nodes

__all__ = ["MAX_NAMES", "forced_texts", "json_name", "property_names", "warm_keys"]

# Property names whose keys are tokenized ahead (12 texts each; the encoder keeps 8192).
MAX_NAMES = 256
# Before a key's name: nothing (after `{"` or `,"`), or the separator itself where the token
# before it ended a value with it (llguidance's forced text then begins at that token).
_LEADS = ("", ',"', '","')
# After a key's colon: a string's quote, an array's or an object's bracket, or nothing (a
# number, literal or a value of several types).
_OPENERS = ('"', "[", "{", "")
# Texts forced between keys and values whatever the names.
_COMMON = ('{"', '":"', '"', '","', '":', ',"')


def property_names(schema: Any) -> list[str]:
    """Every name under a `properties` of `schema`, in first-seen order."""
    found: dict[str, None] = {}
    for node in schema_nodes(schema):
        props = node.get("properties")
        if isinstance(props, dict):
            found.update((n, None) for n in props if isinstance(n, str))
    return list(found)


def json_name(name: str) -> str:
    """`name` as a JSON document writes it between its quotes: escaped as JSON escapes, and
    other characters as they are (llguidance writes `{"é":`, not `{"\\u00e9":`)."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def forced_texts(schema: Any) -> list[str]:
    """The texts `warm_keys` tokenizes for `schema`: the common separators, then for each
    property name (at most `MAX_NAMES`) its key's text after the opening quote with each
    value opening (`name":"`, `name":[`, `name":{`, `name":`), each also after `,"` and
    `","` (`","name":"`)."""
    texts = list(_COMMON)
    for name in property_names(schema)[:MAX_NAMES]:
        key = json_name(name) + '":'  # the name as JSON writes it, its closing quote, colon
        texts += [lead + key + opener for lead in _LEADS for opener in _OPENERS]
    return texts


def warm_keys(schema: Any, encode: Callable[[bytes], list[int]] | None) -> int:
    """Tokenize `forced_texts(schema)` with `encode` (the vocabulary's, which remembers them);
    how many texts. Nothing without an encoder."""
    if encode is None:
        return 0
    texts = forced_texts(schema)
    for text in texts:
        encode(text.encode("utf-8"))
    return len(texts)
