"""Schema -> regex lowering (outlines-core's input) under the compile time limit.

The lowering is pure Python (`schema_regex.json_schema.schema_to_regex`) and usually takes
milliseconds, but a schema with many mutually recursive $refs or optional properties can run for
minutes before it is refused, and Python code cannot be interrupted from another thread. So with a
limit it runs in a forked child that is killed when the limit runs out: the parent waits on a pipe,
not on the work. Forking copies no memory up front (copy-on-write): measured ~5-20 ms for a process
holding the model, against 0.28 s p50 for the outlines-core compile that follows.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import time

from quantkit.errors import GrammarError
from quantkit.grammar.constraints import Grammar
from quantkit.grammar.outlines.schema_regex.json_schema import WHITESPACE, schema_to_regex

__all__ = ["lower_schema"]


def _child(conn: object, schema: object, whitespace: str) -> None:
    try:
        lowered = schema_to_regex(schema, whitespace=whitespace)
        answer: tuple[str, object] = ("ok", (lowered.regex, lowered.notes))
    except GrammarError as e:
        answer = ("error", str(e))
    except RecursionError:
        answer = ("error", "schema: nested too deeply to lower (recursion limit)")
    conn.send_bytes(pickle.dumps(answer))  # type: ignore[attr-defined]


def lower_schema(
    grammar: Grammar, *, timeout_s: float | None, limit_s: float | None = None
) -> Grammar:
    """`grammar` with its regex (lowered from its schema now if it has none), within
    `timeout_s` (None: in this process, without a limit); GrammarError naming the phase."""
    if grammar.regex is not None:
        return grammar
    if timeout_s is None:
        lowered = schema_to_regex(grammar.schema, whitespace=WHITESPACE)
        return dataclasses.replace(grammar, regex=lowered.regex, notes=lowered.notes)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, grammar.schema, WHITESPACE), daemon=True)
    started = time.perf_counter()
    proc.start()
    child.close()
    try:
        ready = parent.poll(timeout_s)
        answer = pickle.loads(parent.recv_bytes()) if ready else None
    except EOFError:  # the child died without answering (out of memory, a crash)
        answer = ("error", "schema: lowering it crashed the lowering process")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    if answer is None:
        raise GrammarError(
            f"{grammar.label}: lowering the schema to a regex took longer than the limit of "
            f"{limit_s or timeout_s:g} s (--compile-timeout; phase: lowering, stopped after "
            f"{time.perf_counter() - started:.1f} s)"
        )
    kind, value = answer
    if kind == "error":
        raise GrammarError(f"{grammar.label}: {value}")
    regex, notes = value  # type: ignore[misc]
    return dataclasses.replace(grammar, regex=regex, notes=tuple(notes))
