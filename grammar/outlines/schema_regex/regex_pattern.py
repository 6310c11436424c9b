"""ECMA-262 `pattern` -> the regex of the JSON strings whose value matches it.

A JSON Schema `pattern` constrains the *decoded* string, while the grammar matches the JSON
text, so every character the pattern allows becomes either itself (when JSON writes it raw) or
its JSON escape (`\\"`, `\\n`, ...). Character sets are kept as code point ranges so that
intersections and complements are exact. See `regex_parts` for why bounded repetitions stay
within ASCII.
"""

from __future__ import annotations

import re

from quantkit.errors import GrammarError
from quantkit.grammar.outlines.schema_regex.regex_parts import BOUNDED_STRING_CAP

__all__ = ["pattern_string_regex"]

# What a complement (`.`, `[^...]`, `\D`) ranges over: printable ASCII without the quote and
# the backslash, so it never needs an escape alternative (which, inside a bounded repetition,
# slows the index construction down by orders of magnitude).
_PRINTABLE_ASCII = [(0x20, 0x21), (0x23, 0x5B), (0x5D, 0x7E)]
# JSON escapes (as regexes) for characters that cannot appear raw inside a JSON string.
_JSON_ESCAPES = {0x22: r'\\"', 0x5C: r"\\\\", 0x08: r"\\b", 0x0C: r"\\f", 0x0A: r"\\n"}
_JSON_ESCAPES |= {0x0D: r"\\r", 0x09: r"\\t"}
_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x9F), (0xD800, 0xDFFF)]


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _subtract(
    ranges: list[tuple[int, int]], remove: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    out = []
    for lo, hi in _normalize(ranges):
        pieces = [(lo, hi)]
        for rlo, rhi in remove:
            nxt = []
            for plo, phi in pieces:
                if rhi < plo or rlo > phi:
                    nxt.append((plo, phi))
                    continue
                if plo < rlo:
                    nxt.append((plo, rlo - 1))
                if rhi < phi:
                    nxt.append((rhi + 1, phi))
            pieces = nxt
        out += pieces
    return _normalize(out)


def _char(code: int) -> str:
    """A character for a regex class, in a spelling Rust's regex and Python's re both read."""
    ch = chr(code)
    if ch.isascii() and ch.isalnum():
        return ch
    return (
        f"\\x{code:02X}"
        if code <= 0xFF
        else f"\\u{code:04X}"
        if code <= 0xFFFF
        else f"\\U{code:08X}"
    )


_CATEGORIES = {
    "CATEGORY_DIGIT": [(0x30, 0x39)],
    "CATEGORY_WORD": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    # The whitespace ECMA-262 and Python's re agree on and JSON can write.
    "CATEGORY_SPACE": [(0x09, 0x0A), (0x0C, 0x0D), (0x20, 0x20)],
}


class _PatternTranslator:
    """ECMA-262 `pattern` -> the regex of a JSON string whose value fully matches it.

    Read with Python's own regex parser (the syntax both share). Complements (`.`, `[^...]`,
    `\\D`, `\\W`, `\\S`) are taken within printable ASCII, so Unicode categories, which ECMA-262
    and Python's re define differently, never decide what is produced.
    """

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def fail(self, why: str) -> GrammarError:
        return GrammarError(f"pattern {self.pattern!r}: {why}")

    def parse(self) -> list:
        """The pattern's items with ^/$ at its ends (or at the ends of each top-level
        alternative) removed. JSON Schema patterns search: full-matching the unanchored body is
        a subset of the strings that contain a match, so dropping them is sound."""
        import re._constants as c  # type: ignore[import-not-found]
        import re._parser as sre_parse  # type: ignore[import-not-found]

        self.c = c
        try:
            parsed = sre_parse.parse(self.pattern)
        except re.error as e:
            raise self.fail(f"expected a regular expression, got a syntax error: {e}") from e
        self.widths = parsed.getwidth()  # anchors have no width: the same once stripped
        if parsed.state.flags & (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
            raise self.fail("inline flags such as (?i) are not supported")
        return self._strip(list(parsed))

    def _strip(self, items: list) -> list:
        c = self.c
        if len(items) == 1 and items[0][0] == c.SUBPATTERN and not any(items[0][1][1:3]):
            return [(c.SUBPATTERN, (*items[0][1][:3], self._strip(list(items[0][1][3]))))]
        if len(items) == 1 and items[0][0] == c.BRANCH:
            return [(c.BRANCH, (None, [self._strip(list(alt)) for alt in items[0][1][1]]))]
        if items and items[0][0] == c.AT and items[0][1] in (c.AT_BEGINNING, c.AT_BEGINNING_STRING):
            items = items[1:]
        if items and items[-1][0] == c.AT and items[-1][1] in (c.AT_END, c.AT_END_STRING):
            items = items[:-1]
        return items

    def translate(self, min_length: int = 0, max_length: int | None = None) -> str:
        items = self.parse()
        if min_length == 0 and max_length is None:
            return self._seq(items)
        # With length bounds: fine if every match already fits them; or, for one repeated
        # character class (`^[a-z0-9-]+$`, the common case), narrow the repetition's bounds.
        low, high = self.widths
        if low >= min_length and (max_length is None or high <= max_length):
            return self._seq(items)
        c = self.c
        if len(items) == 1 and items[0][0] in (c.MAX_REPEAT, c.MIN_REPEAT):
            rep_lo, rep_hi, body = items[0][1]
            if len(body) == 1 and body[0][0] in (c.IN, c.LITERAL, c.ANY, c.CATEGORY):
                lo = max(rep_lo, min_length)
                hi = max_length if rep_hi == c.MAXREPEAT else min(rep_hi, max_length or rep_hi)
                if hi is not None and lo > hi:
                    raise self.fail(f"no string of {min_length}..{max_length} characters matches")
                if hi is None:
                    return self._item(c.MAX_REPEAT, (lo, c.MAXREPEAT, body))
                # Bounded: ASCII only and capped, as for plain strings (see the docstring).
                top = max(lo, min(hi, BOUNDED_STRING_CAP))
                ascii_only = _subtract(self._ranges(body[0]), [(0x7F, 0x10FFFF)])
                return f"(?:{self._charset(ascii_only)}){{{lo},{top}}}"
        raise self.fail(
            "keyword 'pattern' together with minLength/maxLength is only supported for one "
            "repeated character class, or when the pattern's own lengths fit"
        )

    def _ranges(self, item) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
        op, av = item
        c = self.c
        if op == c.LITERAL:
            return [(av, av)]
        if op == c.ANY:
            return _PRINTABLE_ASCII
        if op == c.CATEGORY:
            return self._category(av)
        return self._class(av)

    def _seq(self, items: list) -> str:
        return "".join(self._item(op, av) for op, av in items)

    def _item(self, op, av) -> str:  # type: ignore[no-untyped-def]
        c = self.c
        if op == c.LITERAL:
            return self._charset([(av, av)])
        if op == c.NOT_LITERAL:
            return self._charset(_subtract(_PRINTABLE_ASCII, [(av, av)]))
        if op == c.ANY:
            return self._charset(_PRINTABLE_ASCII)
        if op == c.IN:
            return self._charset(self._class(av))
        if op == c.CATEGORY:
            return self._charset(self._category(av))
        if op == c.BRANCH:
            return "(?:" + "|".join(self._seq(list(alt)) for alt in av[1]) + ")"
        if op == c.SUBPATTERN:
            _, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise self.fail("inline flags such as (?i) are not supported")
            return "(?:" + self._seq(list(sub)) + ")"
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            lo, hi, sub = av
            top = "" if hi == c.MAXREPEAT else str(hi)
            return f"(?:{self._seq(list(sub))}){{{lo},{top}}}"
        if op == c.AT:
            raise self.fail("expected ^ and $ only at the ends, got an anchor in the middle")
        if op in (c.ASSERT, c.ASSERT_NOT):
            raise self.fail("lookahead/lookbehind cannot be expressed by a regular grammar")
        if op in (c.GROUPREF, c.GROUPREF_EXISTS):
            raise self.fail("backreferences cannot be expressed by a regular grammar")
        raise self.fail(f"unsupported regex construct {op}")

    def _category(self, name) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
        key = str(name)
        if key.startswith("CATEGORY_NOT_"):
            positive = _CATEGORIES.get(key.replace("_NOT_", "_"))
            if positive is not None:
                return _subtract(_PRINTABLE_ASCII, positive)
        elif key in _CATEGORIES:
            return _CATEGORIES[key]
        raise self.fail(f"unsupported character category {key}")

    def _class(self, items: list) -> list[tuple[int, int]]:
        c = self.c
        negate = bool(items) and items[0][0] == c.NEGATE
        ranges: list[tuple[int, int]] = []
        for op, av in items[1:] if negate else items:
            if op == c.LITERAL:
                ranges.append((av, av))
            elif op == c.RANGE:
                ranges.append(av)
            elif op == c.CATEGORY:
                ranges += self._category(av)
            else:
                raise self.fail(f"unsupported item {op} in a character class")
        return _subtract(_PRINTABLE_ASCII, ranges) if negate else _normalize(ranges)

    def _charset(self, ranges: list[tuple[int, int]]) -> str:
        safe = _subtract(ranges, _UNSAFE)
        escapes = [
            _JSON_ESCAPES[code]
            for code in sorted(_JSON_ESCAPES)
            if any(lo <= code <= hi for lo, hi in ranges)
        ]
        options = []
        if safe:
            body = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in safe)
            options.append(f"[{body}]")
        options += escapes
        if not options:
            raise self.fail("a character class matches no character a JSON string can hold")
        return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def pattern_string_regex(
    pattern: str, *, min_length: int = 0, max_length: int | None = None
) -> str:
    """The regex of JSON strings whose value fully matches ECMA-262 `pattern` (see
    `_PatternTranslator`) and has min..max characters; GrammarError for lookarounds,
    backreferences, flags, and length bounds it cannot combine with the pattern."""
    return f'"{_PatternTranslator(pattern).translate(min_length, max_length)}"'
