"""The llguidance rows finish: budget steering along a walk to completion (`llguidance.closing`),
steering out of runaways (`llguidance.runaway`), no key twice in any object, and `strict`
schemas (`grammar.strict`). A 'model' here is a preference list: each step it takes the first
of its wishes the processor leaves allowed (else the lowest allowed id), as a greedy model
stuck in a loop would."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import torch

from quantkit.grammar.compiler import compile_grammar
from quantkit.grammar.constraints import lark_grammar, regex_grammar, validate_json
from quantkit.grammar.llguidance.closing import ClosingWalk
from quantkit.grammar.llguidance.engine import HEADROOM
from quantkit.grammar.llguidance.runaway import MAX_DEPTH, MAX_NUMBER, repeats
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.strict import strict_schema
from quantkit.grammar.vocabulary import TokenVocabulary
from tests.hand_vocab import EOS, vocab_of
from tests.hand_vocab import llguidance as llg

PIECES = [*'{}[]":,abcdefghijklmnopqrstuvwxyz0123456789.-', '"a":', '{"a":', "ab", "00",
          '"a":1,', "BEF_", '"name":"', "true", '","']  # fmt: skip

pytestmark = pytest.mark.usefixtures("grammar_home")


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return vocab_of(PIECES)


def _id(piece: str) -> int:
    return PIECES.index(piece) + 1


def greedy(processor: GrammarLogitsProcessor, vocab: TokenVocabulary, wishes: list[str],
           *, steps: int) -> tuple[str, bool]:  # fmt: skip
    """Decode with a model that always scores `wishes` highest, in that order; (text, ended
    with EOS within `steps`)."""
    scores = torch.zeros(vocab.size)
    for rank, piece in enumerate(wishes):
        scores[_id(piece)] = 100.0 - rank
    scores -= torch.arange(vocab.size) * 1e-3  # then the lowest id
    ids, out = torch.zeros((1, 1), dtype=torch.long), []
    for _ in range(steps):
        token = int(processor(ids, scores[None].clone()).argmax())
        if token in EOS:
            return b"".join(vocab.token_bytes[t] for t in out).decode(), True
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return b"".join(vocab.token_bytes[t] for t in out).decode(), False


def no_repeated_keys(text: str) -> bool:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"repeated key in {text}"
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return True


def test_a_runaway_number_is_ended(vocab) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text, ended = greedy(GrammarLogitsProcessor(llg(schema, vocab)), vocab, ["00", "0", "1"],
                         steps=200)  # fmt: skip
    assert ended and validate_json(text, schema) is None, text
    assert len(str(json.loads(text)["n"])) <= MAX_NUMBER + 1, text


def test_a_string_caught_in_a_loop_is_closed(vocab) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    text, ended = greedy(GrammarLogitsProcessor(llg(schema, vocab)), vocab, ["BEF_", "b"],
                         steps=200)  # fmt: skip
    assert ended and validate_json(text, schema) is None, text
    assert text.startswith('{"name":"BEF_BEF_BEF_') and len(text) < 80, text


def test_a_sentence_said_again_in_a_string_is_closed(vocab) -> None:
    """A model writing one 52-byte sentence over and over inside a string (no piece of 32 bytes
    or less repeats): the string is closed once the sentence has been written twice."""
    sentence = [*"abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnop"]
    schema = {"type": "object", "properties": {"d": {"type": "string"}}, "required": ["d"]}
    processor = GrammarLogitsProcessor(llg(schema, vocab))
    script = ["{", '"', "d", '"', ":", '"', *sentence * 10]
    ids, out = torch.zeros((1, 1), dtype=torch.long), []
    for step in range(len(script) + 8):
        scores = -torch.arange(vocab.size) * 1e-3  # past its script: the lowest allowed id
        if step < len(script):
            scores[_id(script[step])] = 100.0
        token = int(processor(ids, scores[None].clone()).argmax())
        if token in EOS:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    text = b"".join(vocab.token_bytes[t] for t in out).decode()
    assert validate_json(text, schema) is None, text
    value = json.loads(text)["d"]
    assert value.startswith("".join(sentence * 2)) and len(value) < 3 * len(sentence), text


def test_nesting_stops_deepening_and_a_required_depth_is_still_reached(vocab) -> None:
    text, ended = greedy(GrammarLogitsProcessor(llg({}, vocab)), vocab, ['{"a":', "1", "}"],
                         steps=200)  # fmt: skip
    assert ended and text.count("{") == MAX_DEPTH, text
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_DEPTH + 3):  # a schema that asks for more depth gets it
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"],
                "additionalProperties": False}  # fmt: skip
    text, ended = greedy(GrammarLogitsProcessor(llg(deep, vocab)), vocab, ["1", "}"], steps=200)
    assert ended and validate_json(text, deep) is None and text.count("{") == MAX_DEPTH + 3


def test_no_object_gets_a_key_twice(vocab) -> None:
    # additionalProperties, patternProperties and declared keys: llguidance lets each repeat.
    for schema in ({"type": "object"},
                   {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}},
                   {"type": "object", "properties": {"a": {"type": "integer"}},
                    "additionalProperties": {"type": "integer"}}):  # fmt: skip
        processor = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=40)
        text, ended = greedy(processor, vocab, ['"a":1,', "}"], steps=40)
        assert ended and validate_json(text, schema) is None and no_repeated_keys(text), text
        assert text.startswith('{"a":1,"'), text  # the first was free; the second became another


@pytest.mark.parametrize("budget", [50, 64, 90])
def test_the_budget_closes_a_document_that_would_run_on(vocab, budget: int) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "addr": {"type": "object", "properties": {"city": {"type": "string"}},
                 "required": ["city"]}},
        "required": ["name", "tags", "addr"], "additionalProperties": False}  # fmt: skip
    processor = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=budget)
    # "abc..." strings never repeat a short period: only the budget can end this one.
    text, ended = greedy(processor, vocab, [*"abcdefghijklmnopqrstuvwxyz"], steps=budget)
    assert ended and validate_json(text, schema) is None, text
    assert processor.steered == {0}
    unsteered = GrammarLogitsProcessor(llg(schema, vocab))
    _, ended = greedy(unsteered, vocab, [*"abcdefghijklmnopqrstuvwxyz"], steps=budget)
    assert not ended  # without the budget the same model runs on


def test_a_steered_greedy_row_takes_the_masks_token_as_the_only_finite_one(vocab) -> None:
    """Greedy under budget steering: each step's pick is the masked processor's, and where
    the row is steered to one token the logits come back -inf everywhere else (the reused
    buffer's last pick cleared, whatever came between)."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
        "required": ["name", "tags"], "additionalProperties": False}  # fmt: skip
    fast = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=40, greedy=True)
    plain = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=40)
    scores = torch.zeros(vocab.size)
    for rank, piece in enumerate("abcdefghij"):
        scores[_id(piece)] = 100.0 - rank
    scores -= torch.arange(vocab.size) * 1e-3
    ids, single = torch.zeros((1, 1), dtype=torch.long), 0
    for _ in range(40):
        out = fast(ids, scores[None].clone())
        token = int(out.argmax())
        assert token == int(plain(ids, scores[None].clone()).argmax())
        finite = torch.isfinite(out[0]).nonzero().flatten().tolist()
        if len(finite) == 1:
            assert finite == [token] and out[0, token] == scores[token]
            single += 1
        if token in EOS:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    else:
        raise AssertionError("no EOS within the budget")
    assert fast.steered == {0} and single >= 3


def test_the_budget_on_a_regex_and_random_logits(vocab) -> None:
    compiled = compile_grammar(regex_grammar('"[a-j ]*"'), vocab, engine="llguidance",
                               timeout_s=10)  # fmt: skip
    for seed in range(4):
        processor = GrammarLogitsProcessor(compiled, max_new_tokens=10 + seed)
        gen = torch.Generator().manual_seed(seed)
        ids, out = torch.zeros((1, 1), dtype=torch.long), []
        for _ in range(10 + seed):
            masked = processor(ids, torch.randn(1, vocab.size, generator=gen) * 3)
            token = int(torch.multinomial(masked.softmax(-1), 1, generator=gen))
            if token in EOS:
                break
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
        else:
            raise AssertionError(f"seed {seed}: no EOS within the budget")
        text = b"".join(vocab.token_bytes[t] for t in out).decode()
        assert text.startswith('"') and text.endswith('"') and len(text) >= 2, text


def test_the_closing_walk_completes_and_leaves_the_row_alone(vocab) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 2,
              "items": {"type": "integer"}}}, "required": ["a"]}  # fmt: skip
    row = llg(schema, vocab).new_row()
    for piece in ('{"a":', "[", "1"):
        assert row.advance(_id(piece))
    path, complete = row.closing_path(limit=100)
    assert complete and json.loads('{"a":[1' + path.decode())["a"][0] == 1
    assert not row.is_finished()  # the walk ran on a copy
    walk = ClosingWalk.of(vocab)
    assert walk.along(b'"a":1,') == [_id('"'), _id('"a":'), _id('"a":1,')]
    line = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
    row.fill(line)
    assert line.any()


def test_repeats() -> None:
    assert repeats(b"xBEF_BEF_BEF_BEF_BEF_BEF_")
    assert not repeats(b"abcdefghijklmnopqrstuvwxyz")
    assert not repeats(b"aaaa")  # too short to call a loop
    assert repeats(b"a" * 30)


def test_strict_closes_objects_that_say_nothing() -> None:
    schema = {"type": "object", "properties": {
        "bp": {"type": "object", "properties": {"systolic": {"type": "integer"}}},
        "free": {"type": "object", "additionalProperties": True},
        "enum": {"enum": [{"x": 1}]}},
        "allOf": [{"properties": {"b": {}}}]}  # fmt: skip
    out = strict_schema(schema)
    assert out["properties"]["bp"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True
    assert "additionalProperties" not in out  # beside allOf: its properties live there
    assert "additionalProperties" not in out["allOf"][0]
    assert out["properties"]["enum"] == {"enum": [{"x": 1}]}  # data is not a schema
    assert "additionalProperties" not in schema["properties"]["bp"]  # not changed in place
    assert validate_json('{"bp":{"systolic":1,"other":2}}', out) is not None


def test_strict_in_the_grammar(vocab) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    loose = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=30)
    text, _ = greedy(loose, vocab, ['"a":1,', '"', "b"], steps=30)
    assert json.loads(text).keys() - {"a"}, text  # undeclared keys: JSON Schema allows them
    strict = GrammarLogitsProcessor(llg(strict_schema(schema), vocab), max_new_tokens=30)
    text, ended = greedy(strict, vocab, ['"a":1,', '"', "b"], steps=30)
    assert ended and json.loads(text).keys() == {"a"}, text


def test_the_closing_walk_writes_no_repeated_key(vocab) -> None:
    # Two keys of a pattern: the grammar alone would let the walk close with "a" again.
    schema = {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}},
              "additionalProperties": False, "minProperties": 2}  # fmt: skip
    row = llg(schema, vocab).new_row()
    for piece in ('{"a":', "1", ","):
        assert row.advance(_id(piece))
    assert row.row.closing_path(limit=200) == (b'"a":0}', True)  # what the grammar allows
    path, complete = row.closing_path(limit=200)
    text = '{"a":1,' + path.decode()
    assert complete and no_repeated_keys(text) and validate_json(text, schema) is None, text


def test_an_array_repeating_one_item_is_closed(vocab) -> None:
    schema = {"type": "array", "items": {"type": "string"}}
    text, ended = greedy(GrammarLogitsProcessor(llg(schema, vocab)), vocab,
                         ['"name":"', "ab", '"', ","], steps=300)  # fmt: skip
    assert ended and validate_json(text, schema) is None, text
    items = json.loads(text)
    assert 4 <= len(items) <= 12 and len(set(items)) == 1, text


def test_an_array_repeating_one_string_item_written_across_tokens_is_closed(vocab) -> None:
    """Each `","` token ends one item and opens the next: the array is never seen between
    items, so the repeat is caught inside the item being written again."""
    schema = {"type": "array", "items": {"type": "string"}}
    processor = GrammarLogitsProcessor(llg(schema, vocab))
    want = b'["' + b'","'.join([b"BEF_BEF_x"] * 12) + b'"]'
    ids, written = torch.zeros((1, 1), dtype=torch.long), b""
    for _ in range(300):
        masked = processor(ids, torch.zeros(1, vocab.size))
        allowed = [t for t in range(vocab.size) if torch.isfinite(masked[0, t]) and t not in EOS]
        going = [t for t in allowed if want[len(written) :].startswith(vocab.token_bytes[t])]
        if not going:
            break
        token = max(going, key=lambda t: len(vocab.token_bytes[t]))
        written += vocab.token_bytes[token]
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    items = written.decode().count("BEF_BEF_x")
    assert 4 <= items < 12, written  # stopped well before the model's twelfth


def test_a_key_that_could_only_end_as_a_written_one_is_not_begun(vocab) -> None:
    """`{"ab":1,"a` could only go on as "ab" again: the screen (`key_corners`) clears `a`
    before the model takes it, so the greedy 'model' writes the other name instead of a
    repeat (the row would otherwise have to let the repeat through)."""
    schema = {"type": "object", "patternProperties": {"^(ab|cd)$": {"type": "integer"}},
              "additionalProperties": False, "minProperties": 2}  # fmt: skip
    processor = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=60)
    text, ended = greedy(processor, vocab, ['"', "a", "b", ":", "1", ",", "c", "d", "}"],
                         steps=60)  # fmt: skip
    assert ended and no_repeated_keys(text) and validate_json(text, schema) is None, text
    assert json.loads(text).keys() == {"ab", "cd"}, text


def test_a_new_key_is_found_below_many_cornered_ones(vocab) -> None:
    """Nine written one-letter keys are the model's nine best tokens at the tenth key, each a
    corner: the screen goes on past them to the new name (a held-out Vega-Lite output wrote
    `"y"`, `"color"`, `"shape"` again when its eight best tokens were corners, and only those
    eight were screened)."""
    schema = {"type": "object", "patternProperties": {"^[a-j]$": {"type": "integer"}},
              "additionalProperties": False}  # fmt: skip
    processor = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=120)
    wishes = ['"', *"abcdefghi", ":", ",", "1", "j", "}"]
    text, ended = greedy(processor, vocab, wishes, steps=120)
    assert ended and no_repeated_keys(text) and validate_json(text, schema) is None, text
    assert json.loads(text).keys() == set("abcdefghij"), text


def test_a_value_that_would_close_into_a_cornered_key_is_not_closed_so(vocab) -> None:
    """`{"ab":"","cd":"` then `","`: one token closes the value and opens a key of an object
    whose every name is written (the corner entered from inside a string value, as a held-out
    JSONSchemaBench output did). The screen reads where the token leaves the text, not its
    first byte, so `","` is cleared and the value closes with `"` instead."""
    value = {"type": "string", "pattern": "^[a-z]*$"}  # no `,` inside: `","` can only close
    schema = {"type": "object", "patternProperties": {"^(ab|cd)$": value},
              "additionalProperties": False}  # fmt: skip
    processor = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=60)
    text, ended = greedy(processor, vocab, ['","', '"', "a", "b", "c", "d", ":", "}"], steps=60)
    assert ended and no_repeated_keys(text) and validate_json(text, schema) is None, text
    assert json.loads(text) == {"ab": "", "cd": ""}, text


def test_a_walk_through_a_repeat_the_grammar_asks_for_completes(vocab) -> None:
    """Seven booleans of a `minItems: 7` array look like a loop (`true,` again and again); the
    walk walks on through it (`closing._GRACE`) instead of giving up, so the row can be
    steered to finish."""
    days = {"type": "array", "items": {"type": "boolean"}, "minItems": 7, "maxItems": 7}
    schema = {"type": "object", "properties": {"d": days}, "required": ["d"],
              "additionalProperties": False}  # fmt: skip
    row = llg(schema, vocab).new_row()
    path, complete = row.closing_path(limit=400)
    assert complete, path
    assert len(json.loads(path)["d"]) == 7, path


def test_a_walk_from_inside_a_run_of_zeros_leaves_it(vocab) -> None:
    """A date-time's fraction takes digits for ever and ends only at `z` or an offset: a walk
    from a row already deep in `000…` does not begin with more zeros (the row would follow
    them and the next walk would begin the same way); it reads the row's text as the start of
    the loop and takes another byte first."""
    stamp = {"type": "string", "format": "date-time"}
    schema = {"type": "object", "properties": {"t": stamp}, "required": ["t"],
              "additionalProperties": False}  # fmt: skip
    row = llg(schema, vocab).new_row()
    for char in '{"t":"2023-08-22t14:22:22.' + "0" * 40:
        assert row.advance(_id(char)), char
    path, complete = row.closing_path(limit=200)
    assert complete and not path.startswith(b"0"), path
    text = '{"t":"2023-08-22t14:22:22.' + "0" * 40 + path.decode()
    assert validate_json(text, schema) is None, text


def test_a_walk_leaves_a_recursion_at_the_branch_it_took_each_time_round(vocab) -> None:
    """A spec whose "spec" is a spec again (or a leaf): from a row already three levels down,
    the walk's preferred bytes would take the recursive branch for ever (its decision comes
    after values that end, so no byte of the loop is still avoided there). It takes last the
    bytes that followed the same text before, and leaves by the leaf."""
    nested = {"anyOf": [{"$ref": "#/$defs/node"}, {"$ref": "#/$defs/leaf"}]}
    text = {"type": "string"}
    node = {"type": "object", "additionalProperties": False,
            "properties": {"name": text, "repeat": text, "resolve": text, "next": nested},
            "required": ["name", "repeat", "resolve", "next"]}  # fmt: skip
    leaf = {"type": "object", "additionalProperties": False,
            "properties": {"name": text, "repeat": text, "resolve": text,
                           "nexz": {"type": "integer"}},
            "required": ["name", "repeat", "resolve", "nexz"]}  # fmt: skip
    schema = {"$defs": {"node": node, "leaf": leaf}, "$ref": "#/$defs/node"}
    row = llg(schema, vocab).new_row()
    prefix = '{"name":"","repeat":"","resolve":"","next":' * 3
    for char in prefix:
        assert row.advance(_id(char)), char
    path, complete = row.closing_path(limit=400)
    assert complete and len(path) < 120, path
    assert validate_json(prefix + path.decode(), schema) is None, path


def test_a_lark_list_the_model_would_go_on_with_is_closed_in_time(vocab) -> None:
    """A list whose `,` the walk prefers over the byte that leaves it: every walk took the
    list round again, and a row following them wrote items to the limit. Walks read the row's
    own text (every grammar, not only JSON schemas) and leave at the `,` that continued it."""
    grammar = 'start: "x" COLS "z" TABLE\nCOLS: COL ("," COL)*\nCOL: "ab" | "cd" | "ef"\n' \
        'TABLE: "u" | "v"\n'  # fmt: skip
    compiled = compile_grammar(lark_grammar(grammar), vocab, engine="llguidance", timeout_s=10)
    row = compiled.new_row()
    for char in "xab,ab,ab,ab":
        assert row.advance(_id(char)), char
    assert row.closing_path(limit=60) == (b"zu", True)
    processor = GrammarLogitsProcessor(compiled, max_new_tokens=24)
    text, ended = greedy(processor, vocab, [",", "ab"], steps=24)
    assert ended and re.fullmatch(r"xab(,ab)*z[uv]", text), text


def test_a_walk_stuck_in_a_value_it_cannot_finish_is_no_way_not_a_path_to_follow(vocab) -> None:
    """An email needs an `@` this vocabulary cannot write: the walk goes round in the local part
    to its limit, its avoided bytes changing the loop (`}}}…0000a0000…`). That is no way (a
    path shorter than the limit), not a path longer than fits, which the row would follow from
    its first token (the embedded model's person.json, `make demo`'s schema, ran to the limit
    so)."""
    schema = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}},
              "required": ["e"], "additionalProperties": False}  # fmt: skip
    row = llg(schema, vocab).new_row()
    for char in '{"e":"':
        assert row.advance(_id(char)), char
    path, complete = row.closing_path(limit=300)
    assert not complete and len(path) < 300, path


# The email of JSONSchemaStore's "Freifunk Community API 0.5.2" schema: a pattern beside the
# format (llguidance takes both), a dot and two letters after the `@`.
EMAIL_PATTERN = "^[A-Za-z0-9_\\-\\.]+@[A-Za-z0-9_\\-\\.]+\\.[A-Za-z]{2,}$"


@pytest.mark.parametrize("pattern", [None, EMAIL_PATTERN])
def test_a_walk_going_round_in_an_email_finds_its_way_out(pattern: str | None) -> None:
    """An email's local part goes round on any of its bytes, and only an `@` leads on, which
    no preferred byte is; after it the domain goes round too, ended only by a `.` (and, with
    the pattern, two letters). The walk searches for the way out of the lexeme it goes round
    in (`closing._Exit`), and finds a short complete path; it walked a byte more at each turn
    (`0000a0000t0000f…`) and ran past the limit, and the row followed that path to the token
    limit (JSONSchemaBench, JsonSchemaStore 0.5.2)."""
    vocab = vocab_of([*PIECES, "@"])  # PIECES keep their ids
    email = {"type": "string", "format": "email"} | ({"pattern": pattern} if pattern else {})
    schema = {"type": "object", "properties": {"e": email}, "required": ["e"],
              "additionalProperties": False}  # fmt: skip
    row = llg(schema, vocab).new_row()
    for char in '{"e":"0000':
        assert row.advance(_id(char)), char
    path, complete = row.closing_path(limit=60)
    assert complete and len(path) < 20, path
    assert validate_json('{"e":"0000' + path.decode(), schema) is None, path
    processor = GrammarLogitsProcessor(llg(schema, vocab), max_new_tokens=48)
    text, ended = greedy(processor, vocab, ["00", "0"], steps=48)
    assert ended and validate_json(text, schema) is None, text


def test_repeats_answers_as_the_plain_definition() -> None:
    """`repeats` skips a period whose last byte differs from the byte a period before it;
    the answers must be the definition's: the last `times * period` bytes are one piece."""

    def plain(data: bytes, least: int, total: int, longest: int) -> bool:
        for period in range(1, longest + 1):
            times = max(least, -(-total // period))
            if times * period > len(data):
                return False
            if data[len(data) - times * period :] == data[len(data) - period :] * times:
                return True
        return False

    gen = np.random.default_rng(1)
    for case in range(3000):
        piece = bytes(gen.integers(97, 97 + int(gen.integers(1, 4)), int(gen.integers(1, 9))))
        noise = bytes(gen.integers(97, 100, int(gen.integers(0, 20))))
        data = (noise + piece * int(gen.integers(0, 30)))[-int(gen.integers(0, 120)) :]
        for least, total, longest in ((3, 24, 32), (2, 96, 128), (4, 40, 40), (2, 96, 256),
                                      (1, 8, 16)):  # fmt: skip
            got = repeats(bytearray(data), least=least, total=total, longest=longest)
            assert got == plain(data, least, total, longest), (case, data)
    for case in range(500):  # long pieces: the sentence rule's periods of up to 256 bytes
        piece = bytes(gen.integers(97, 100, int(gen.integers(1, 200))))
        noise = bytes(gen.integers(97, 100, int(gen.integers(0, 300))))
        data = (noise + piece * int(gen.integers(0, 5)))[-int(gen.integers(0, 700)) :]
        for least, total, longest in ((2, 96, 256), (3, 24, 32)):
            got = repeats(bytearray(data), least=least, total=total, longest=longest)
            assert got == plain(data, least, total, longest), (case, data)


@pytest.fixture
def walks(monkeypatch) -> list[int]:
    """One entry per walk a row makes (`ClosingWalk.path`), not counting a walk's own second
    try (`finishing`, when it went round)."""
    calls: list[int] = []
    real = ClosingWalk.path

    def counted(self: ClosingWalk, *args: Any, **kwargs: Any) -> tuple[bytes, bool]:
        if not kwargs.get("finishing"):
            calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ClosingWalk, "path", counted)
    return calls


def test_rows_take_the_compiles_first_walk_and_walk_again_only_off_its_path(vocab, walks) -> None:
    """Every row of a grammar begins in the same state, so the compile walks from it once
    (`LlgIndex.start_walk`) and a row's first walk is that one, whatever its token limit
    (its first `limit` bytes, not complete, where it is shorter); a row that has written
    only the path's first bytes since its last walk takes the rest of that path; a row that
    left the path walks for itself."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 2,
              "items": {"type": "integer"}}}, "required": ["a"]}  # fmt: skip
    compiled = llg(schema, vocab)
    start, complete = compiled.index.start_walk
    assert complete and json.loads(start.decode())["a"]  # a complete document
    walks.clear()  # the compile's own walk, when it compiled here
    row = compiled.new_row()
    assert row.closing_path(limit=len(start) + 1) == (start, True)
    assert row.closing_path(limit=len(start)) == (start, False)  # cut at the limit
    assert row.closing_path(limit=4) == (start[:4], False) and not walks
    along = compiled.new_row()
    opener = _id('{"a":')
    assert start.startswith(b'{"a":') and along.advance(opener)
    assert along.closing_path(limit=97) == (start[len(b'{"a":') :], True) and not walks
    off = compiled.new_row()
    assert off.advance(opener) and off.advance(_id("[")) and off.advance(_id("1"))
    assert not start.startswith(b'{"a":[1')
    path, complete = off.closing_path(limit=97)
    assert len(walks) == 1 and complete and json.loads('{"a":[1' + path.decode())["a"]
    assert off.closing_path(limit=97) == (path, True) and len(walks) == 1  # kept


def test_a_row_too_long_for_its_budget_follows_its_kept_walk(vocab, walks) -> None:
    """A walk goes `HEADROOM` bytes past its limit: a row that follows the path it cuts at
    the limit takes the rest for later steps, cut again at each step's limit, and once the
    rest fits, the rest as complete; one walk in all."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 40,
              "items": {"type": "integer"}}}, "required": ["a"]}  # fmt: skip
    row = llg(schema, vocab).new_row()
    walks.clear()  # the compile's own walk, when it compiled here
    for piece in ('{"a":', "[", "1"):
        assert row.advance(_id(piece))
    path, complete = row.closing_path(limit=20)
    assert not complete and len(path) == 20 and len(walks) == 1
    whole, ended = row.row.last_walk[0], row.row.last_walk[3]
    assert ended and len(whole) < 20 + HEADROOM  # 38 items and the brackets: within reach
    written = 0
    while written < len(whole):
        token = row.along(whole[written:])[-1]
        assert row.advance(token)
        written += len(vocab.token_bytes[token])
        rest = whole[written:]
        want = (rest, True) if len(rest) < 20 else (rest[:20], False)
        assert row.closing_path(limit=20) == want
    assert row.is_finished() and len(walks) == 1
