"""Regexes for JSON leaf values: literals, bounded numbers, string formats, lengths, patterns.

Everything here is written for outlines-core's regex engine (Rust `regex` syntax, restricted to
what Python's `re` reads the same way, so tests can check it with `re`) and matches
the *JSON text* of a value, so a string regex includes its quotes and only ever produces
characters that are legal unescaped inside a JSON string (or a JSON escape sequence).

Every regex is *sound* rather than complete: each text it matches is valid for the constraint
it came from, but some valid values are not produced (no exponents in bounded numbers, ASCII
only in bounded-length strings). A grammar may be narrower than the schema; it must never be
wider, or a constrained output could fail validation.

Why ASCII inside bounded repetitions: outlines-core's index construction explodes on a bounded
repetition of a class that spans all of Unicode. Measured on SmolLM2's 49k-token vocabulary:
the JSON string body repeated {0,16} took 67 s, {0,64} ran past 10 minutes and 9 GB, while the
printable-ASCII class repeated {0,64} takes 1.3 s and {0,256} 6 s; unbounded `*` takes 10 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from quantkit.errors import GrammarError

__all__ = [
    "BOUNDED_STRING_CAP",
    "FORMATS",
    "FRACTIONAL_NUMBER",
    "STRING",
    "any_value_regex",
    "escape_literal",
    "object_regex",
    "integer_regex",
    "json_literal_regex",
    "number_regex",
    "string_length_regex",
]

# The body of a JSON string, character by character (the same class outlines-core uses).
STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
STRING = f'"{STRING_CHAR}*"'
# Digits are unbounded: `{0,15}` instead of `*` made indexes several times slower to build (a
# number occurs many times in a schema's regex); a "1000000..." loop is cut by the processor's
# token budget instead (see `budget`).
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
# Numbers that are never integers (a non-zero digit after the point, no exponent).
FRACTIONAL_NUMBER = r"-?(?:0|[1-9][0-9]*)\.[0-9]*[1-9][0-9]*"
# Printable ASCII minus the quote and the backslash: never needs escaping in JSON.
ASCII_CHAR = r"[ !#-\[\]-~]"
# The longest bounded string we spell out (see the module docstring for the cost); longer
# maxLength values are lowered to this, which is sound since the output is still short enough.
BOUNDED_STRING_CAP = 32
# |bounds| above this are clamped (soundly: the range only narrows), so that a maximum of 1e308
# does not spell out a 309-digit range.
_BOUND_CLAMP = 10**15

_META = set("\\.+*?()|[]{}^$#&-~")


def escape_literal(text: str) -> str:
    """`text` as a regex matching exactly that text."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _META:
            out.append("\\" + ch)
        elif code < 0x20 or 0x7F <= code <= 0x9F:
            out.append(f"\\x{code:02X}")
        else:
            out.append(ch)
    return "".join(out)


def json_literal_regex(values: Sequence[object]) -> str:
    """An alternation of the compact JSON texts of `values` (enum / const)."""
    import json

    texts = {json.dumps(v, separators=(",", ":"), ensure_ascii=False) for v in values}
    # Longest first: outlines-core's automaton is leftmost-first, so once an earlier
    # alternative has matched the whole text a later, longer one ("12" after "1") is cut off.
    texts = sorted(texts, key=lambda t: (-len(t), t))
    return "(?:" + "|".join(escape_literal(t) for t in texts) + ")"


def _repeat(item: str, separator: str, low: int, high: int | None) -> str:
    """low..high copies of `item` separated by `separator` (high None: unbounded)."""
    more_lo = max(low - 1, 0)
    more_hi = "" if high is None else str(high - 1)
    body = f"{item}(?:{separator}{item}){{{more_lo},{more_hi}}}"
    return body if low >= 1 else f"(?:{body})?"


def object_regex(value: str, *, whitespace: str, low: int = 0, high: int | None = None) -> str:
    """Objects with any string keys and `value` values, low..high members (high >= 1).

    quantkit writes this itself: outlines-core 0.2.14 ignores minProperties/maxProperties on
    objects without `properties` (its count pattern is computed, then not used).
    """
    member = f"{STRING}{whitespace}:{whitespace}(?:{value})"
    members = _repeat(member, f"{whitespace},{whitespace}", low, high)
    return f"\\{{{whitespace}{members}{whitespace}\\}}"


def any_value_regex(whitespace: str) -> str:
    """Any JSON value, nested at most one level (scalars, and arrays or objects of scalars):
    sound for "any value", with an index a fraction of a deeper one's. (Bounding the number of
    members too made indexes slower to build; the token budget ends a loop instead.)"""
    scalar = f"(?:{STRING}|{NUMBER}|true|false|null)"
    sep = f"{whitespace},{whitespace}"
    array = f"\\[{whitespace}{_repeat(scalar, sep, 0, None)}{whitespace}\\]"
    members = object_regex(scalar, whitespace=whitespace, high=None)
    return f"(?:{scalar}|{array}|{members})"


# --------------------------------------------------------------------------- integers


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _same_length(a: str, b: str) -> list[str]:
    """Regexes for the decimal numbers from a to b, both with len(a) == len(b) digits."""
    if len(a) == 1:
        return [_digit_class(int(a), int(b))]
    if a[0] == b[0]:
        return [a[0] + rest for rest in _same_length(a[1:], b[1:])]
    n = len(a) - 1
    out: list[str] = []
    first, last = int(a[0]), int(b[0])
    if a[1:] != "0" * n:
        out += [a[0] + rest for rest in _same_length(a[1:], "9" * n)]
        first += 1
    if b[1:] != "9" * n:
        out += [b[0] + rest for rest in _same_length("0" * n, b[1:])]
        last -= 1
    if first <= last:
        out.append(_digit_class(first, last) + f"[0-9]{{{n}}}")
    return out


def _nonneg_range(lo: int, hi: int | None) -> list[str]:
    """Regexes for the integers lo..hi (hi None: unbounded), lo >= 0, no leading zeros."""
    out: list[str] = []
    while hi is None or lo <= hi:
        digits = len(str(lo))
        top = 10**digits - 1
        if hi is None:
            out += _same_length(str(lo), str(top))
            out.append(f"[1-9][0-9]{{{digits},}}")
            break
        out += _same_length(str(lo), str(min(hi, top)))
        lo = top + 1
    return out[::-1]  # more digits first (see `_alternation`)


def _alternation(parts: list[str]) -> str:
    """Alternatives in the order given: callers put those that produce longer texts first,
    since outlines-core's automaton is leftmost-first (see `json_literal_regex`)."""
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def integer_regex(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> str:
    """JSON integers in the given range (None: unbounded); GrammarError if it is empty."""
    lo = None if minimum is None else math.floor(minimum) + 1 if exclusive_minimum else minimum
    hi = None if maximum is None else math.ceil(maximum) - 1 if exclusive_maximum else maximum
    lo = None if lo is None else max(math.ceil(lo), -_BOUND_CLAMP)
    hi = None if hi is None else min(math.floor(hi), _BOUND_CLAMP)
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(
            f"integer bounds: expected a non-empty range, got [{minimum}, {maximum}] "
            f"(exclusive min {exclusive_minimum}, max {exclusive_maximum})"
        )
    parts: list[str] = []
    if hi is None or hi >= 0:
        parts += _nonneg_range(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        parts += ["-" + p for p in _nonneg_range(mag_lo, None if lo is None else -lo)]
    return _alternation(parts)


# --------------------------------------------------------------------------- numbers

_FRACTION = r"(?:\.[0-9]+)?"
_NONZERO_FRACTION = r"\.[0-9]*[1-9][0-9]*"


def _magnitude(lo: int, lo_excl: bool, hi: int | None, hi_excl: bool) -> list[str]:
    """Decimal magnitudes m (no sign, no exponent) with lo <(=) m <(=) hi; 0 <= lo."""
    parts: list[str] = []
    first = lo + 1 if lo_excl else lo
    last = None if hi is None else hi - 1
    # Longest texts first (see `_alternation`): hi exactly ("10" before "1"), then the
    # fractions of lo, then the integer parts, most digits first.
    if hi is not None and not hi_excl and (hi > lo or (hi == lo and not lo_excl)):
        parts.append(str(hi))  # m == hi exactly
    if lo_excl and (hi is None or lo < hi):  # lo < m < lo + 1: lo then a non-zero fraction
        parts.append(str(lo) + _NONZERO_FRACTION)
    if last is None or first <= last:  # integer part in [first, last], any fraction
        parts += [p + _FRACTION for p in _nonneg_range(first, last)]
    return parts


def _integral_bound(
    value: float | None, *, exclusive: bool, upper: bool
) -> tuple[int | None, bool]:
    """A bound narrowed to an integer: minimum 0.5 becomes minimum 1 (inclusive), and so on."""
    if value is None:
        return None, False
    if float(value).is_integer():
        bound, excl = int(value), exclusive
    else:  # the nearest integer inside the range is strictly inside: inclusive from now on
        bound, excl = (math.floor(value), False) if upper else (math.ceil(value), False)
    return max(-_BOUND_CLAMP, min(_BOUND_CLAMP, bound)), excl


def number_regex(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> str:
    """JSON numbers in the range. Unbounded: any JSON number. Bounded: plain decimals (no
    exponent) between the bounds narrowed to integers, which keeps the regex small and sound."""
    if minimum is None and maximum is None:
        return NUMBER
    lo, lo_excl = _integral_bound(minimum, exclusive=exclusive_minimum, upper=False)
    hi, hi_excl = _integral_bound(maximum, exclusive=exclusive_maximum, upper=True)
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_excl or hi_excl))):
        raise GrammarError(
            f"number bounds: expected a non-empty range with an integer inside, got "
            f"[{minimum}, {maximum}] (exclusive min {exclusive_minimum}, max {exclusive_maximum})"
        )
    parts: list[str] = []
    if hi is None or hi > 0 or (hi == 0 and not hi_excl):  # values >= 0
        if lo is None or lo < 0:
            parts += _magnitude(0, False, hi, hi_excl)
        else:
            parts += _magnitude(lo, lo_excl, hi, hi_excl)
    if lo is None or lo < 0:  # values < 0, as "-" + magnitude
        mag_lo, mag_lo_excl = (0, True) if hi is None or hi >= 0 else (-hi, hi_excl)
        mag_hi = None if lo is None else -lo
        parts += ["-" + p for p in _magnitude(mag_lo, mag_lo_excl, mag_hi, lo_excl)]
    if not parts:
        raise GrammarError(f"number bounds: expected a non-empty range, got [{minimum}, {maximum}]")
    return _alternation(parts)


# --------------------------------------------------------------------------- strings

_YEAR = "[1-9][0-9]{3}"  # datetime rejects year 0; four digits keeps RFC 3339's form
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_YEAR = "(?:[1-9][0-9](?:0[48]|[2468][048]|[13579][26])|(?:[2468][048]|[13579][26])00)"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_OFFSET = "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_TIME = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{{1,6}})?{_OFFSET}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_HEX4 = "[0-9a-f]{1,4}"
_LABEL = "[a-z0-9]{1,16}"
_HOST = f"{_LABEL}(?:\\.{_LABEL}){{0,3}}"
_URI = f"https?://{_HOST}(?:/[A-Za-z0-9._~-]*)*"

# format -> (regex of the string body, shortest, longest or None). Each regex produces only
# values that the format's RFC accepts (and jsonschema's format checker, where it has one).
FORMATS: dict[str, tuple[str, int, int | None]] = {
    "date": (_DATE, 10, 10),
    "time": (_TIME, 9, 22),
    "date-time": (f"{_DATE}T{_TIME}", 20, 33),
    "email": ("[a-z0-9_+-]+(?:\\.[a-z0-9_+-]+)*@[a-z0-9]+(?:\\.[a-z0-9]+)+", 5, None),
    "idn-email": ("[a-z0-9_+-]+(?:\\.[a-z0-9_+-]+)*@[a-z0-9]+(?:\\.[a-z0-9]+)+", 5, None),
    "hostname": (_HOST, 1, 67),
    "idn-hostname": (_HOST, 1, 67),
    "ipv4": (f"{_OCTET}(?:\\.{_OCTET}){{3}}", 7, 15),
    "ipv6": (f"{_HEX4}(?::{_HEX4}){{7}}", 15, 39),
    "uuid": ("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", 36, 36),
    "uri": (_URI, 8, None),
    "uri-reference": (_URI, 8, None),
    "iri": (_URI, 8, None),
    "iri-reference": (_URI, 8, None),
    "uri-template": ("[A-Za-z0-9/:._-]*", 0, None),
    "json-pointer": ("(?:/[A-Za-z0-9._-]*)*", 0, None),
    "relative-json-pointer": ("(?:0|[1-9][0-9]*)(?:#|(?:/[A-Za-z0-9._-]*)*)", 1, None),
    "duration": ("P(?:[0-9]{1,4}[YMWD]|T[0-9]{1,4}[HMS])", 3, 7),
    "regex": ("[A-Za-z0-9 _-]*", 0, None),
}


def string_length_regex(min_length: int, max_length: int | None) -> str:
    """JSON strings of min..max characters. Unbounded above: any characters after a printable
    ASCII prefix of min_length; bounded: printable ASCII, max lowered to BOUNDED_STRING_CAP."""
    if max_length is not None and max_length < min_length:
        raise GrammarError(
            f"string length: expected minLength <= maxLength, got {min_length} > {max_length}"
        )
    if min_length > 256:
        raise GrammarError(
            f"minLength: expected at most 256 (longer strings make the index too large), "
            f"got {min_length}"
        )
    if max_length is None:
        prefix = "" if min_length == 0 else f"{ASCII_CHAR}{{{min_length}}}"
        return f'"{prefix}{STRING_CHAR}*"'
    top = max(min_length, min(max_length, BOUNDED_STRING_CAP))
    return f'"{ASCII_CHAR}{{{min_length},{top}}}"'
