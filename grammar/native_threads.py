"""Native work run on a thread under a time limit, and how a process ends while such work may
still run.

llguidance's grammar build and outlines-core's index load run in native code that cannot be
cancelled. The caller waits for them on a daemon thread up to its limit and abandons them after
(`run_with_limit`), on a stack as large as the work needs (`stack_bytes`: llguidance's build
recurses once per rule of a chain of rules). An abandoned thread that returns from native code
while the interpreter finalizes is ended by Python 3.11 with pthread_exit, whose forced unwind
through llguidance's Rust frames crashes the process: "Segmentation fault" after the output,
exit 139 (gdb: the build thread in PyEval_RestoreThread -> take_gil -> PyThread_exit_thread ->
_Unwind_ForcedUnwind -> llguidance's _lib.abi3.so, while the main thread was in Py_FinalizeEx).
It happened to `quantkit generate --compile-timeout 0.01` and to the JSONSchemaBench benchmark.
So a program that may have abandoned such work ends through `exit_process`: it waits for the
abandoned threads a bounded time and, if one still runs, runs the `atexit` callbacks, flushes
its output and ends with os._exit, skipping only the finalization that would crash.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

# How long the end of a process waits for abandoned native work before skipping finalization.
SETTLE_S = 5.0

_abandoned: list[threading.Thread] = []
_lock = threading.Lock()
_stack_lock = threading.Lock()


def run_with_limit(
    fn: Callable[[], Any],
    timeout_s: float | None,
    *,
    name: str,
    stack_bytes: int | None = None,
) -> tuple[bool, Any]:
    """Run `fn` on a daemon thread and wait for it up to `timeout_s` seconds (None: no limit):
    (True, its result), its exception raised again here (not lost as a timeout), or (False,
    None) when the limit came first; then the thread is abandoned and remembered for
    `exit_process`. stack_bytes: the thread's stack (address space, mapped as it is touched),
    for native code that recurses as deep as its input nests; None: the platform's default."""
    answer: list[Any] = []

    def work() -> None:
        try:
            answer.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            answer.append(e)

    worker = _started(work, name, stack_bytes)
    try:
        worker.join(None if timeout_s is None else max(timeout_s, 0.0))
    finally:  # a Ctrl-C during the wait abandons the work too
        if worker.is_alive():
            with _lock:
                _abandoned.append(worker)
    if not answer:
        return False, None
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return True, answer[0]


def _started(work: Callable[[], None], name: str, stack_bytes: int | None) -> threading.Thread:
    """A started daemon thread running `work`, on a stack of `stack_bytes` where the platform
    grants it (the size is process-wide state: set and restored under a lock), else on the
    default stack: a smaller stack only lowers how deep the work can recurse."""
    if stack_bytes is not None:
        with _stack_lock:
            previous = threading.stack_size()
            try:
                threading.stack_size(stack_bytes)
            except (ValueError, RuntimeError):  # a size this platform does not take
                pass
            else:
                try:
                    worker = threading.Thread(target=work, daemon=True, name=name)
                    worker.start()
                    return worker
                except RuntimeError:  # that much address space cannot be mapped here
                    pass
                finally:
                    threading.stack_size(previous)
    worker = threading.Thread(target=work, daemon=True, name=name)
    worker.start()
    return worker


def still_running() -> list[threading.Thread]:
    """The abandoned threads that have not finished yet."""
    with _lock:
        return [t for t in _abandoned if t.is_alive()]


def exit_process(code: int, *, settle_s: float = SETTLE_S) -> NoReturn:
    """End the process with `code`: normally (sys.exit) when no abandoned native work runs, or
    after `settle_s` seconds of waiting for it, through os._exit once the `atexit` callbacks
    have run and the output is flushed (see the module docstring)."""
    deadline = time.monotonic() + settle_s
    for thread in still_running():
        thread.join(max(0.0, deadline - time.monotonic()))
    if still_running():
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: the exit code still says it
                pass
        os._exit(code)
    sys.exit(code)
