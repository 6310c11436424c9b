"""Context-free grammars from files, for `--grammar FILE`: Lark in llguidance's dialect as
written, or llama.cpp's GBNF (a file ending in .gbnf) converted to Lark by the converter
llguidance ships (`llguidance.gbnf_to_lark`); either is checked by llguidance before a model
loads. Only llguidance compiles them: outlines-core takes regular languages only.

Everything after reading the file runs under the compile time limit (`--compile-timeout`), on
one thread the caller stops waiting for at the limit: the conversion is Python and grows
quadratically with chained rules (2000 rules: 9.7 s, nearly all in its fixed point over which
rules are terminals), the syntax check is native code that grows with the grammar (40000
rules: 1.9 s). The time used counts against the same limit when the grammar is compiled for
the model's tokenizer (`compiler.compile_grammar(spent_s=...)`).

Whatever does not convert is one GrammarError line naming the file and the construct: a
token reference (llama.cpp's <[id]>, <|name|>, !<...>: token ids of llama.cpp's model, with no
text to write in Lark), a rule used and never defined, no `root` rule, or text the converter
cannot read (the line and the text where it stopped).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.constraints import Grammar, lark_grammar, read_option_file
from quantkit.grammar.llguidance.engine import BUILD_STACK_BYTES, import_llguidance
from quantkit.grammar.llguidance.lark import check_syntax, text_accepted
from quantkit.grammar.native_threads import run_with_limit

__all__ = ["GBNF_SUFFIX", "gbnf_to_lark", "grammar_from_text", "lark_accepts", "load_grammar_file"]

GBNF_SUFFIX = ".gbnf"

# The converter's own messages (plain Exceptions), reworded: (pattern, what to say).
_RESOLVE_ERRORS = (
    (re.compile(r"Rule '(.+)' not found"), "rule `{0}` is used but never defined"),
    (re.compile(r"No 'root' rule found"), "expected a rule named `root` (where GBNF starts), got "
     "none"),
    (re.compile(r"Rule '(.+)' already exists"), "two rules are both named `{0}` in Lark (root "
     "becomes start, `-` becomes `_`, fooBar becomes foo_bar)"),
)  # fmt: skip


def load_grammar_file(path: str | Path, *, timeout_s: float | None) -> Grammar:
    """The Lark grammar in the file at `path` (converted from GBNF for a .gbnf file), with its
    syntax checked by llguidance within `timeout_s` (None: no limit); GrammarError otherwise."""
    path = Path(path)
    text = _read(path)
    gbnf = path.suffix.lower() == GBNF_SUFFIX
    return grammar_from_text(text, gbnf=gbnf, where=f"--grammar {path}", timeout_s=timeout_s,
                             label=f"grammar {path.name}", origin=path)  # fmt: skip


def grammar_from_text(text: str, *, gbnf: bool, where: str, timeout_s: float | None,
                      label: str = "grammar", origin: str | Path = "<gbnf>",
                      limit_hint: str = "--compile-timeout") -> Grammar:  # fmt: skip
    """`text` (Lark, or GBNF converted to it) as a Grammar, its syntax checked by llguidance
    within `timeout_s`; a GrammarError starting with `where` otherwise (a file's option, a
    request's field)."""
    phase = ["GBNF conversion" if gbnf else "syntax check"]
    gave_up = threading.Event()

    def work() -> str | None:
        lark = gbnf_to_lark(text, origin) if gbnf else text
        if gave_up.is_set():  # the caller has reported the limit: no native work after it
            return None
        phase[0] = "syntax check"
        problem, _ = check_syntax(lark)  # the warnings come again from the compile
        if problem is not None:
            raise GrammarError(f"{where}: {_syntax_error(problem, text, gbnf)}")
        return lark

    done, lark = run_with_limit(
        work, timeout_s, name="quantkit-grammar-check", stack_bytes=BUILD_STACK_BYTES
    )
    if not done:
        gave_up.set()
        raise GrammarError(
            f"{where}: checking it took longer than the limit of {timeout_s or 0:g} s "
            f"({limit_hint}; phase: {phase[0]}); simplify the grammar or raise the limit"
        )
    return lark_grammar(lark, label=label)


def lark_accepts(grammar: Grammar, text: str) -> bool:
    """Whether the Lark `grammar` derives exactly `text`, checked by a new matcher over single
    bytes (`llguidance.lark.text_accepted`), not by the one that constrained the output."""
    if grammar.kind != "lark" or grammar.lark is None:
        raise GrammarError(f"{grammar.label}: expected a Lark grammar, got a {grammar.kind} one")
    return text_accepted(grammar.lark, text.encode("utf-8"))


def _read(path: Path) -> str:
    """The file's text; GrammarError if it cannot be read, is not UTF-8 or is empty."""
    text = read_option_file("--grammar", path, "UTF-8 text")
    if not text.strip():
        raise GrammarError(f"--grammar {path}: expected a grammar, got an empty file")
    return text


def _syntax_error(problem: str, text: str, gbnf: bool) -> str:
    """llguidance's one-line reason, saying which text its line numbers count in."""
    if gbnf:  # the positions are in the Lark the converter wrote, not in the file
        return f"llguidance cannot compile its Lark conversion: {problem}"
    hint = ""
    if re.search(r"(?m)^\s*[\w-]+\s*::=", text):
        hint = f" (this looks like GBNF: name the file *{GBNF_SUFFIX} to convert it)"
    return f"llguidance cannot compile it: {problem}{hint}"


def gbnf_to_lark(text: str, path: str | Path = "<gbnf>") -> str:
    """`text` (GBNF) as a Lark grammar, by llguidance's converter; GrammarError naming `path`
    and the construct when it cannot convert (see the module docstring)."""
    try:
        from llguidance.gbnf_to_lark import GbnfToLarkError
        from llguidance.gbnf_to_lark import gbnf_to_lark as convert
    except ImportError as e:
        import_llguidance()  # a MissingExtraError when llguidance itself is missing
        raise GrammarError(
            f"--grammar {path}: expected an llguidance with its GBNF converter "
            f"(llguidance.gbnf_to_lark), got one without; write the grammar in Lark"
        ) from e
    try:
        return convert(text)
    except GbnfToLarkError as e:
        reason = _stopped_at(e)
    except RecursionError:
        reason = "parentheses nested too deeply to convert"
    except IndexError:  # the converter reads past the text's end
        reason = "the file ends inside a literal, a character class or an escape"
    except Exception as e:  # the converter raises plain Exceptions, and may fail on input it
        reason = _resolve_error(e)  # does not expect: each one is "cannot convert"
    raise GrammarError(f"--grammar {path}: cannot convert GBNF to Lark: {reason}")


def _stopped_at(error: Any) -> str:
    """'line N: REASON at `TEXT`' for the converter's parse error (TEXT: where it stopped), or
    'REASON at the end of the file'."""
    where = error.pos  # the converter's Position: the whole text and an offset into it
    message = str(error).removesuffix(f" at {where}")
    if not where.text[where.pos :].strip():
        return f"{message} at the end of the file"
    line = where.text.count("\n", 0, where.pos) + 1
    rest = where.text[where.pos :].split("\n", 1)[0].strip()
    construct = f"`{rest[:40]}`" if rest else "the end of the line"
    if rest.startswith(("<", "!<")):
        message = (
            "a token reference (llama.cpp's <...>: a token id of its model) has no Lark form; "
            "write the text it stands for"
        )
    return f"line {line}: {message} at {construct}"


def _resolve_error(error: Exception) -> str:
    message = " ".join(str(error).split()) or type(error).__name__
    for pattern, say in _RESOLVE_ERRORS:
        found = pattern.search(message)
        if found:
            return say.format(*found.groups())
    return message
