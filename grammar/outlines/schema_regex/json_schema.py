"""JSON Schema -> regex, sound: every text the regex matches validates against the schema.

outlines-core's `build_regex_from_schema` assembles objects, arrays, unions and whitespace, but
on its own it silently drops keywords it does not know (`minimum`, `not`, `uniqueItems`, the
properties of an object that also has `anyOf`, ...) and concatenates `allOf` branches, so its
regex can accept invalid JSON. quantkit therefore *lowers* the schema first into the subset that
outlines-core handles exactly:

- `$ref` (local, `#/...` or the root `$id`) is inlined; recursion is cut after `max_ref_depth`
  expansions by dropping the optional property / union branch / array items that recurse
  (a required recursion that deep is an error);
- `allOf` is merged into one schema (`merge`); `anyOf`/`oneOf` siblings are distributed
  into the branches; `oneOf` is accepted only where its branches cannot overlap;
- leaves (strings, numbers, integers, enum, const) become placeholder constants whose regexes
  come from `regex_parts` and are substituted into outlines-core's output;
- keywords that cannot be expressed (`not`, `if`/`then`/`else`, `contains`, `dependentSchemas`,
  `multipleOf` other than integers, `$dynamicRef`, ...) raise a GrammarError naming the keyword
  and where it is; unknown keywords are annotations, as the specification says, and ignored.

Where a keyword could be honoured only by a larger index, the grammar is narrowed instead (it
stays sound): bounded strings are ASCII and at most `BOUNDED_STRING_CAP` long, arrays with
`uniqueItems` hold at most one item, arrays and generic objects at most `COUNT_CAP` entries
beyond their minimum. Each narrowing is recorded in `SchemaRegex.notes`.
"""

from __future__ import annotations

import json
import re
import secrets
import urllib.parse
from dataclasses import dataclass
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.outlines.schema_regex.merge import close_branch, merge_schemas
from quantkit.grammar.outlines.schema_regex.objects import (
    COUNT_CAP,
    NEVER,
    counts,
    lower_array,
    lower_object,
)
from quantkit.grammar.outlines.schema_regex.regex_parts import (
    BOUNDED_STRING_CAP,
    FORMATS,
    FRACTIONAL_NUMBER,
    STRING,
    any_value_regex,
    escape_literal,
    integer_regex,
    json_literal_regex,
    number_regex,
    string_length_regex,
)
from quantkit.grammar.outlines.schema_regex.regex_pattern import pattern_string_regex
from quantkit.grammar.outlines.schema_regex.unions import (
    ALL_TYPES,
    FRACTIONAL,
    apply_not,
    lower_union,
)
from quantkit.grammar.vocabulary import import_outlines_core

__all__ = ["COUNT_CAP", "WHITESPACE", "SchemaRegex", "check_schema", "schema_to_regex"]

# At most one space between tokens: a model cannot pad a document with whitespace until it
# runs out of tokens, and compact JSON (no space at all) is still accepted.
WHITESPACE = r"[ ]?"
# The regex outlines-core would have to compile beyond this is a schema too big to serve.
_MAX_REGEX_CHARS = 2_000_000
# Inlining mutually recursive $refs (A -> B -> C -> A ...) grows exponentially with the number of
# definitions even at a small depth per definition; past this many subschemas, give up early.
_MAX_SUBSCHEMAS = 5_000

_UNSUPPORTED = {
    "contains": "'contains' (an item somewhere in the array) is not supported",
    "dependentSchemas": "conditional schemas are not supported",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "dynamic references are not supported",
    "unevaluatedItems": "'unevaluatedItems' is only supported as true, false or {}",
}
_OBJECT_KEYS = {"properties", "required", "additionalProperties", "patternProperties",
                "minProperties", "maxProperties", "propertyNames", "dependentRequired",
                "dependencies", "unevaluatedProperties"}  # fmt: skip
_ARRAY_KEYS = {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "additionalItems",
               "unevaluatedItems"}  # fmt: skip
_STRING_KEYS = {"minLength", "maxLength", "pattern", "format"}
_NUMBER_KEYS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}


@dataclass(frozen=True)
class SchemaRegex:
    regex: str
    notes: tuple[str, ...]  # where the grammar is narrower than the schema, and why


def check_schema(schema: Any) -> Any:
    """The validator class for `schema` (its `$schema`, default 2020-12), after checking the
    schema against its metaschema; GrammarError saying what is wrong if it is not a schema."""
    from jsonschema import Draft202012Validator, SchemaError, validators

    if not isinstance(schema, dict | bool):
        raise GrammarError(
            f"schema: expected a JSON Schema (an object or a boolean), got {type(schema).__name__}"
        )
    cls = validators.validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(
            f"schema: expected a valid JSON Schema, got an error at {where}: {e.message}"
        ) from None
    return cls


class _Lowerer:
    def __init__(self, root: Any, *, validator: Any, max_ref_depth: int, whitespace: str) -> None:
        self.root = root
        self.whitespace = whitespace
        self.root_id = root.get("$id") or root.get("id") if isinstance(root, dict) else None
        self.validator = validator
        self.max_ref_depth = max_ref_depth
        self.salt = secrets.token_hex(4)
        while isinstance(root, dict) and self.salt in json.dumps(root):
            self.salt = secrets.token_hex(4)
        self.leaves: dict[str, str] = {}
        self.notes: list[str] = []
        self.visited = 0

    # ---------------------------------------------------------------- helpers

    def leaf(self, regex: str) -> dict[str, Any]:
        name = f"qk{self.salt}n{len(self.leaves)}x"
        self.leaves[name] = regex
        return {"const": name}

    def any_value(self) -> dict[str, Any]:
        """Any JSON value, as a leaf: outlines-core's own regex for `{}` is an alternation
        without parentheses, so inside an array or a property it swallows its neighbours (a
        tuple of one `{}` accepted `[1,2]`)."""
        return self.leaf(any_value_regex(self.whitespace))

    def structure_regex(self, lowered: Any) -> str:
        """outlines-core's regex for a lowered subschema (placeholders left in place)."""
        oc = import_outlines_core()
        try:
            return oc.json_schema.build_regex_from_schema(
                json.dumps({"allOf": [lowered]}), whitespace_pattern=self.whitespace
            )
        except ValueError as e:
            raise GrammarError(f"schema: outlines-core rejected the lowered schema: {e}") from None

    def note(self, where: str, text: str) -> None:
        self.notes.append(f"{where}: {text}")

    def resolve(self, ref: Any, where: str) -> tuple[str, Any]:
        if not isinstance(ref, str):
            raise GrammarError(f"{where}: expected $ref to be a string, got {ref!r}")
        base, _, fragment = ref.partition("#")
        if base and base != self.root_id:
            raise GrammarError(f"{where}: external $ref {ref!r} is not supported (only '#/...')")
        if fragment and not fragment.startswith("/"):  # a location-independent "#name"
            return "#" + fragment, self.anchor(fragment, ref, where)
        node = self.root
        for raw in [p for p in urllib.parse.unquote(fragment).split("/") if p]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GrammarError(f"{where}: $ref {ref!r} does not point into the schema")
        return "#" + fragment, node

    def anchor(self, name: str, ref: str, where: str) -> Any:
        """The subschema declaring `$anchor: name` (or draft 7's `$id: "#name"`)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("$anchor") == name or node.get("$id") == f"#{name}":
                    return node
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        raise GrammarError(f"{where}: $ref {ref!r} names no $anchor in the schema")

    def flatten(self, node: Any, where: str, refs: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
        """`node` with its own `$ref` and `allOf` merged in (recursively)."""
        if not isinstance(node, dict):
            return node, refs
        while isinstance(node, dict) and ("$ref" in node or "allOf" in node):
            node = dict(node)
            if "$ref" in node:
                target_key, target = self.resolve(node.pop("$ref"), where)
                if refs.count(target_key) >= self.max_ref_depth:
                    return NEVER, refs
                refs = (*refs, target_key)
                target, refs = self.flatten(target, where, refs)
                if target is NEVER:
                    return NEVER, refs
                target = close_branch(target)
                node = merge_schemas(node, target, where=where, parent=True)
            else:
                branches = node.pop("allOf")
                if not isinstance(branches, list):
                    raise GrammarError(f"{where}: expected allOf to be a list")
                # The branches are peers (each one's closing keywords judge the others'
                # names); the node holding them is their parent.
                combined: Any = True
                for i, branch in enumerate(branches):
                    branch, refs = self.flatten(branch, f"{where}/allOf/{i}", refs)
                    branch = close_branch(branch)
                    if branch is NEVER:
                        return NEVER, refs
                    combined = merge_schemas(combined, branch, where=where)
                node = merge_schemas(node, combined, where=where, parent=True)
        return node, refs

    # ---------------------------------------------------------------- lowering

    def lower(self, node: Any, where: str, refs: tuple[str, ...]) -> Any:
        self.visited += 1
        if self.visited > _MAX_SUBSCHEMAS:
            raise GrammarError(
                f"schema: expected at most {_MAX_SUBSCHEMAS} subschemas once $refs are inlined, "
                f"got more (deeply or mutually recursive definitions)"
            )
        node, refs = self.flatten(node, where, refs)
        if node is NEVER or node is False:
            return NEVER
        if node is True:
            return self.any_value()
        if not isinstance(node, dict):
            raise GrammarError(f"{where}: expected a schema (an object or a boolean), got {node!r}")
        if "not" in node:
            node = apply_not(self, node, where, refs)
            if node is False:
                return NEVER
        for key, why in _UNSUPPORTED.items():
            if key in node and not (key == "unevaluatedItems" and node[key] in (False, True, {})):
                raise GrammarError(f"{where}: keyword {key!r}: {why}")
        if "if" in node and ("then" in node or "else" in node):
            raise GrammarError(
                f"{where}: keyword 'if'/'then'/'else': conditionals are not supported"
            )
        if "anyOf" in node or "oneOf" in node:
            return lower_union(self, node, where, refs)
        if "enum" in node or "const" in node:
            return self.lower_enum(node, where)
        types = self.types_of(node, where)
        if types is None:
            return self.any_value()
        options = []
        for t in types:
            sub = self.lower_type(t, node, f"{where}", refs)
            if sub is not NEVER:
                options.append(sub)
        if not options:
            return NEVER
        return options[0] if len(options) == 1 else {"anyOf": options}

    def types_of(self, node: dict[str, Any], where: str) -> list[str] | None:
        if "type" in node:
            types = node["type"]
            types = [types] if isinstance(types, str) else list(types)
            unknown = set(types) - {*ALL_TYPES, "integer"}
            if unknown:
                raise GrammarError(f"{where}: unknown type {sorted(unknown)}")
        else:  # no type: a restrictive but sound guess from the keywords present
            keys = set(node)
            types = [t for t, k in (("object", _OBJECT_KEYS), ("array", _ARRAY_KEYS),
                     ("string", _STRING_KEYS), ("number", _NUMBER_KEYS)) if keys & k]  # fmt: skip
            if not types:
                return None
        if "number" in types and "integer" in types:
            types.remove("integer")
        return types

    def lower_enum(self, node: dict[str, Any], where: str) -> Any:
        values = list(node["enum"]) if "enum" in node else [node["const"]]
        if "const" in node and "enum" in node:
            values = [v for v in values if json.dumps(v) == json.dumps(node["const"])]
        rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
        if rest:  # keep the values the rest of the schema also accepts
            check = self.validator.evolve(schema=rest)
            values = [v for v in values if check.is_valid(v)]
        if not values:
            return NEVER
        return self.leaf(json_literal_regex(values))

    def lower_type(self, kind: str, node: dict[str, Any], where: str, refs: tuple) -> Any:
        if kind in ("null", "boolean"):
            return {"type": kind}
        if kind in ("integer", "number"):
            return self.lower_number(kind, node, where)
        if kind == "string":
            return self.lower_string(node, where)
        if kind == "object":
            return lower_object(self, node, where, refs)
        return lower_array(self, node, where, refs)

    def lower_number(self, kind: str, node: dict[str, Any], where: str) -> Any:
        if node.get(FRACTIONAL):
            if kind == "integer" or _NUMBER_KEYS & set(node):
                return NEVER if kind == "integer" else self._fractional_error(where)
            return self.leaf(FRACTIONAL_NUMBER)
        step = node.get("multipleOf")
        if step is not None:
            if not (isinstance(step, int | float) and step > 0 and (1 / step).is_integer()):
                raise GrammarError(
                    f"{where}: keyword 'multipleOf' {step}: only divisors of 1 (1, 0.5, 0.1, "
                    f"...) are supported, by producing integers"
                )
            kind = "integer"
        lo, hi = node.get("minimum"), node.get("maximum")
        lo_x = node.get("exclusiveMinimum", False)
        hi_x = node.get("exclusiveMaximum", False)
        lo_excl = hi_excl = False
        if isinstance(lo_x, bool):  # draft 4: a flag on minimum
            lo_excl = lo_x and lo is not None
        elif lo is None or lo_x >= lo:
            lo, lo_excl = lo_x, True
        if isinstance(hi_x, bool):
            hi_excl = hi_x and hi is not None
        elif hi is None or hi_x <= hi:
            hi, hi_excl = hi_x, True
        build = integer_regex if kind == "integer" else number_regex
        try:
            regex = build(lo, hi, exclusive_minimum=lo_excl, exclusive_maximum=hi_excl)
        except GrammarError as e:
            raise GrammarError(f"{where}: {e}") from None
        return self.leaf(regex)

    @staticmethod
    def _fractional_error(where: str) -> Any:
        raise GrammarError(
            f"{where}: keyword 'not': not integer together with number bounds is not supported"
        )

    def lower_string(self, node: dict[str, Any], where: str) -> Any:
        lo, hi = counts(node, "minLength", "maxLength")
        pattern, fmt = node.get("pattern"), node.get("format")
        if fmt is not None and fmt not in FORMATS:
            self.note(where, f"format {fmt!r} is not enforced (an annotation, as in 2020-12)")
            fmt = None
        try:
            if pattern is not None:
                if fmt is not None:
                    raise GrammarError("keyword 'pattern' together with 'format' is not supported")
                return self.leaf(pattern_string_regex(pattern, min_length=lo, max_length=hi))
            if fmt is not None:
                body, fmt_lo, fmt_hi = FORMATS[fmt]
                if lo > fmt_lo or (hi is not None and (fmt_hi is None or fmt_hi > hi)):
                    raise GrammarError(
                        f"keyword 'format' {fmt!r} together with minLength/maxLength outside "
                        f"[{fmt_lo}, {fmt_hi}] is not supported"
                    )
                return self.leaf(f'"{body}"')
            if lo or hi is not None:
                if hi is not None and hi > max(lo, BOUNDED_STRING_CAP):
                    top = max(lo, BOUNDED_STRING_CAP)
                    self.note(where, f"maxLength {hi} lowered to {top} (ASCII only)")
                return self.leaf(string_length_regex(lo, hi))
        except GrammarError as e:
            raise GrammarError(f"{where}: {e}") from None
        return self.leaf(STRING)


def schema_to_regex(
    schema: Any, *, whitespace: str = WHITESPACE, max_ref_depth: int = 3
) -> SchemaRegex:
    """The regex of the JSON texts that satisfy `schema` (a parsed JSON Schema).

    GrammarError when the schema is not a valid JSON Schema, uses a keyword that cannot be
    expressed (the message names it and its location), or admits no value at all.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"schema: expected JSON text, got invalid JSON ({e})") from None
    cls = check_schema(schema)
    lowerer = _Lowerer(
        schema, validator=cls(schema), max_ref_depth=max_ref_depth, whitespace=whitespace
    )
    lowered = lowerer.lower(schema, "#", ())
    if lowered is NEVER:
        raise GrammarError(
            "schema: no JSON value satisfies it (false schema, empty enum, contradictory "
            "keywords, or a required recursion deeper than the limit)"
        )
    size = len(json.dumps(lowered))
    if size > _MAX_REGEX_CHARS // 8:  # outlines-core would spend seconds making a huge regex
        raise GrammarError(
            f"schema: expected a regex of at most {_MAX_REGEX_CHARS} characters, got a lowered "
            f"schema of {size} already (too many inlined $refs or optional properties)"
        )
    regex = lowerer.structure_regex(lowered)
    # Newest leaf first: a leaf's regex may hold older placeholders (a generic object's value),
    # never newer ones, so one pass in this order leaves none behind.
    for name in reversed(lowerer.leaves):
        regex = regex.replace(escape_literal(json.dumps(name)), f"(?:{lowerer.leaves[name]})")
    if len(regex) > _MAX_REGEX_CHARS:
        raise GrammarError(
            f"schema: expected a regex of at most {_MAX_REGEX_CHARS} characters, got "
            f"{len(regex)} (too many inlined $refs or optional properties)"
        )
    if re.search(f"qk{lowerer.salt}n[0-9]+x", regex):
        raise AssertionError("a leaf placeholder was not substituted")  # internal invariant
    return SchemaRegex(regex=regex, notes=tuple(dict.fromkeys(lowerer.notes)))
