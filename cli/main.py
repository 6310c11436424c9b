"""`quantkit`'s entry point: the error boundary around every command.

Whatever happens after the process starts, imports included, ends in one line on stderr and an
exit code that says which kind of failure it was:

| exit | kind | e.g. |
|---|---|---|
| 2 | usage: an option or argument the command cannot take | `--top-p 2`, an unknown GPU name |
| 3 | input data: a file or text that is not what it claims | a truncated shard, a bad config |
| 4 | environment: the machine, not the input | disk full, permission denied, a missing extra |
| 70 | a bug in quantkit | anything unexpected: the traceback goes to a log file, not the terminal |
| 130 | interrupted | Ctrl-C at any moment |

This module imports nothing heavy at the top, so that a Ctrl-C while torch loads is caught too.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

EXIT_USAGE, EXIT_DATA, EXIT_ENVIRONMENT, EXIT_BUG, EXIT_INTERRUPTED = 2, 3, 4, 70, 130

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
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        code, message = _run(argv)
    finally:
        warnings.showwarning = shown  # in-process callers (tests) get theirs back
    if message:
        _say(message)
    if code:
        sys.exit(code)


def _run(argv: list[str] | None) -> tuple[int, str]:
    """(exit code, the one line to print) for one invocation."""
    try:
        import click

        from quantkit.errors import QuantkitError
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, "interrupted; nothing was written"
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
        return EXIT_ENVIRONMENT, f"error: {_os_line(e)}"
    except RecursionError:
        return EXIT_DATA, "error: input nested too deeply (past Python's recursion limit)"
    except UnicodeError as e:
        return EXIT_DATA, f"error: text is not valid {getattr(e, 'encoding', 'UTF-8')}: {e}"
    except MemoryError:
        return EXIT_ENVIRONMENT, "error: out of memory"
    except Exception as e:  # noqa: BLE001 - the boundary: a bug, reported in one line
        log = _write_crash_log()
        where = f"traceback in {log}" if log else "no traceback log could be written"
        return EXIT_BUG, (
            f"internal error: {type(e).__name__}: {e} ({where}; this is a bug in quantkit, "
            "please report it with that file)"
        )


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
    from quantkit.paths import WRITTEN

    if WRITTEN:  # the Ctrl-C came after an output was complete and in place
        return f"interrupted after writing {', '.join(str(p) for p in WRITTEN)}"
    return "interrupted; nothing was written"


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
