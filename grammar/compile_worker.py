"""Build outlines-core Indexes in a child process, so the parent can enforce a time limit.

outlines-core builds an index in native code that cannot be interrupted from Python, and some
regexes take minutes and gigabytes (see `outlines.schema_regex.regex_parts`). Run here, a compile
that runs past `--compile-timeout` is killed with its process, and an address-space limit turns a
runaway allocation into a failed request instead of the machine running out of memory.

The child is long-lived: it serves one request per line on stdin and answers one line on
stdout, so a benchmark compiling hundreds of grammars pays the interpreter start-up (~0.3 s,
more on a loaded machine) once, not per grammar. A request is a JSON object
{"vocab": PATH, "vocab_key": KEY, "regex": PATH, "out": PATH, "key": KEY}: VOCAB is the cache
entry (`cache_file`) of `outlines_core.Vocabulary`'s binary form, checked against its VOCAB_KEY,
REGEX the pattern (UTF-8), OUT receives the cache entry of the Index's binary form for KEY
(written beside it, synced and renamed, so it never exists half-written). Answers: "ok",
"rejected<TAB>message", "memory", "error<TAB>message"; the first line, once outlines-core is
imported, is "ready".

Usage (internal): python -m quantkit.grammar.compile_worker [MEMORY_BYTES]
Imports nothing heavy (no torch; from quantkit only `cache_file` and `errors`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from quantkit.grammar.cache_file import DamagedEntryError, read_entry, write_entry


def _limit_memory(limit: int) -> None:
    try:
        import resource
    except ImportError:  # not POSIX: no limit, the time limit still applies
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent() -> None:
    # A parent killed without running its exit handlers must not leave a compile running.
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent closes stdin when it exits
        pass


def _serve(request: dict[str, str], vocabularies: dict[str, Any]) -> str:
    import outlines_core

    vocab_path = request["vocab"]
    if vocab_path not in vocabularies:
        data = read_entry(Path(vocab_path), kind="vocab", key=request["vocab_key"])
        vocabularies[vocab_path] = outlines_core.Vocabulary.from_binary(data)
    regex = Path(request["regex"]).read_text(encoding="utf-8")
    try:
        index = outlines_core.Index(regex, vocabularies[vocab_path])
    except ValueError as e:
        message = " ".join(str(e).split()) or type(e).__name__
        return f"rejected\t{message}"
    except MemoryError:
        return "memory"
    _, (data,) = index.__reduce__()
    del index
    write_entry(Path(request["out"]), data, kind="index", key=request["key"])
    return "ok"


def main(argv: list[str]) -> int:
    _die_with_parent()
    if argv:
        _limit_memory(int(argv[0]))
    import outlines_core  # noqa: F401  (imported before "ready": start-up is not compile time)

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    vocabularies: dict[str, Any] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = _serve(json.loads(line), vocabularies)
        except MemoryError:
            answer = "memory"
        except DamagedEntryError as e:  # the vocabulary file changed since the parent checked it
            answer = f"error\t{e}"
        except (OSError, ValueError, KeyError) as e:  # a bad request: answer, keep serving
            answer = f"error\t{type(e).__name__}: {e}"
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
