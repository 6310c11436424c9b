"""`quantkit`'s entry point: the error boundary around every command.

Whatever happens after the process starts, imports included, ends in one line on stderr and an
exit code that says which kind of failure it was:

| exit | kind | e.g. |
|---|---|---|
| 2 | usage: an option or argument the command cannot take | `--top-p 2`, an unknown GPU name |
| 3 | input data: a file or text that is not what it claims | a truncated shard, a bad config |
| 4 | environment: the machine, not the input | disk full, permission denied, a missing extra |
| 5 | out of memory: an allocation the machine could not give | a model larger than the RAM |
| 70 | a bug in quantkit | anything unexpected: the traceback goes to a log file, not the terminal |
| 130 | interrupted | Ctrl-C at any moment |

This module imports nothing heavy at the top, so that a Ctrl-C while torch loads is caught too.

The first Ctrl-C ends the command; every later one is ignored. Python's default would raise a
second KeyboardInterrupt wherever the process then is: in the answer being printed, in a thread
join, an `atexit` callback (torch's finalizer has been hit) or an object's `__del__` during
interpreter shutdown, each a traceback or "Exception ignored in ..." after the one line. So the
first interrupt, and the end of any command, set SIGINT to SIG_IGN: the kernel drops the signal,
whatever the interpreter is doing, until the process is gone.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

EXIT_USAGE, EXIT_DATA, EXIT_ENVIRONMENT, EXIT_MEMORY = 2, 3, 4, 5
EXIT_BUG, EXIT_INTERRUPTED = 70, 130

# OS errors users cause or meet, named in words instead of a traceback.
_OS_WORDS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large (a file-size limit, e.g. ulimit -f)",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "is a directory, expected a file",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long",
    errno.EMFILE: "too many open files",
    errno.ENOMEM: "out of memory",
}


def main(argv: list[str] | None = None) -> None:
    """Run `quantkit ARGV` (None: sys.argv[1:], as the console script and `python -m` call it).

    Called without `argv` this is the process's entry point: all that follows is shutdown, so
    SIGINT stays ignored after it (see the module docstring). A caller that passes `argv`
    (tests, in-process) carries on afterwards, so it gets its SIGINT handler back."""
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    handler = _catch_first_interrupt()
    try:
        code, message = _run(argv)
    except KeyboardInterrupt:  # raised outside `_run`'s handlers (its argument check)
        code, message = EXIT_INTERRUPTED, _interrupted()
    finally:
        _ignore_interrupts()  # the command is over: from here on the process only ends
        warnings.showwarning = shown  # in-process callers (tests) get theirs back
    if message and code != 0:
        message = _with_kept(message)
    if message:
        _say(message)
    if argv is not None and handler is not None:
        signal.signal(signal.SIGINT, handler)
    if argv is None and (threads := sys.modules.get("quantkit.grammar.native_threads")):
        # A grammar build abandoned at --compile-timeout may still run in native code, which
        # crashes interpreter finalization: end as that module says.
        threads.exit_process(code)
    if code:
        sys.exit(code)


def _catch_first_interrupt() -> Any:
    """Make the next SIGINT raise KeyboardInterrupt once and ignore every later one; the handler
    that was there before, or None where none can be set (not the main thread) or restored (one
    set outside Python)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return signal.SIG_IGN  # started with Ctrl-C ignored (e.g. a job in the background)
    try:
        return signal.signal(signal.SIGINT, _interrupt_once)
    except ValueError:  # signals can only be handled in the main thread
        return None


def _interrupt_once(signum: int, frame: object) -> None:
    # Ignored before raising, not after: a second Ctrl-C landing while the first is being
    # answered (or while `finally` blocks clean up) would otherwise raise inside the answer.
    _ignore_interrupts()
    raise KeyboardInterrupt


def _ignore_interrupts() -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals land in the main thread's handler anyway
        pass


def _run(argv: list[str] | None) -> tuple[int, str]:
    """(exit code, the one line to print) for one invocation."""
    try:
        import click

        from quantkit.errors import QuantkitError
        from quantkit.paths import KEPT, WRITTEN
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, "interrupted; nothing was written"
    # What this invocation writes and keeps (an in-process caller runs several).
    WRITTEN.clear()
    KEPT.clear()
    args = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(args, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "backslashreplace").decode()[:60]
            return EXIT_USAGE, f"error: argument {i}: expected UTF-8 text, got {shown!r}"
    try:
        from quantkit.cli.commands import cli

        cli.main(args=argv, prog_name="quantkit", standalone_mode=False)
        return 0, ""
    except QuantkitError as e:
        return getattr(e, "exit_code", EXIT_USAGE), f"error: {e}"
    except (KeyboardInterrupt, click.exceptions.Abort):
        return EXIT_INTERRUPTED, _interrupted()
    except click.ClickException as e:
        return e.exit_code, f"error: {e.format_message()}"
    except click.exceptions.Exit as e:
        return e.exit_code, ""
    except BrokenPipeError:
        # `quantkit generate ... | head`: the reader left; nothing to say, and say it quietly.
        _silence_stdout()
        return 0, ""
    except OSError as e:
        if e.errno == errno.ENOMEM:
            return EXIT_MEMORY, f"error: {_os_line(e)}"
        return EXIT_ENVIRONMENT, f"error: {_os_line(e)}"
    except RecursionError:
        return EXIT_DATA, "error: input nested too deeply (past Python's recursion limit)"
    except UnicodeError as e:
        return EXIT_DATA, f"error: text is not valid {getattr(e, 'encoding', 'UTF-8')}: {e}"
    except MemoryError:
        return EXIT_MEMORY, "error: out of memory"
    except Exception as e:  # noqa: BLE001 - the boundary: a bug, reported in one line
        if (line := _allocation_failure(e)) is not None:
            return EXIT_MEMORY, line
        log = _write_crash_log()
        where = f"traceback in {log}" if log else "no traceback log could be written"
        return EXIT_BUG, (
            f"internal error: {type(e).__name__}: {e} ({where}; this is a bug in quantkit, "
            "please report it with that file)"
        )


def _allocation_failure(e: Exception) -> str | None:
    """The one line for an allocation torch could not make (its CPU allocator raises a plain
    RuntimeError "... DefaultCPUAllocator: can't allocate memory: you tried to allocate N
    bytes ...", CUDA a torch.OutOfMemoryError), or None for any other exception."""
    text = str(e)
    if type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text:
        asked = re.search(r"tried to allocate (\d+) bytes", text)
        size = f" ({int(asked.group(1)) / 2**30:.2f} GiB asked for at once)" if asked else ""
        device = "GPU" if "CUDA" in text or "cuda" in text else "machine"
        return (
            f"error: out of memory: the {device} could not give an allocation{size}; use a "
            f"smaller model, batch or context, or a machine with more memory"
        )
    return None


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """A warning is one line, `warning: MESSAGE`, like every other line the CLI prints; Python's
    default adds the warning's file, line number, class and source line on a second line."""
    _say(f"warning: {message}")


def _interrupted() -> str:
    # A KeyboardInterrupt not raised by `_interrupt_once` (`paths` raises one for a SIGINT it
    # held back) has not set SIGINT aside yet: set it now, before anything else can be hit.
    _ignore_interrupts()
    from quantkit.paths import KEPT, WRITTEN

    if WRITTEN:  # the Ctrl-C came after an output was complete and in place
        return f"interrupted after writing {', '.join(str(p) for p in WRITTEN)}"
    if KEPT:  # work kept for the next run to continue (a quantization's finished layers)
        return f"interrupted; {'; '.join(KEPT)}"
    return "interrupted; nothing was written"


def _with_kept(line: str) -> str:
    """An error's line, and what the command kept for the next run (`paths.KEPT`)."""
    from quantkit.paths import KEPT

    return f"{line} ({'; '.join(KEPT)})" if KEPT else line


def _os_line(e: OSError) -> str:
    words = _OS_WORDS.get(e.errno or -1) or e.strerror or type(e).__name__
    path = e.filename if e.filename is not None else ""
    return f"{path}: {words}" if path else str(words)


def _write_crash_log() -> Path | None:
    """The current exception's traceback in $QUANTKIT_HOME/logs (or the temp dir)."""
    text = traceback.format_exc()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in _log_folders():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"crash-{stamp}-{os.getpid()}.log"
            body = f"quantkit {' '.join(sys.argv[1:])}\n\n{text}"
            path.write_text(body, encoding="utf-8", errors="backslashreplace")
            return path
        except OSError:
            continue
    return None


def _log_folders() -> list[Path]:
    from quantkit.paths import quantkit_home  # light: os, shutil, uuid

    return [quantkit_home() / "logs", Path(tempfile.gettempdir()) / "quantkit-logs"]


def _say(line: str) -> None:
    try:
        print(line.encode("utf-8", "backslashreplace").decode(), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr itself is gone: the exit code still says it


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
