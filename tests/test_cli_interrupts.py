"""Ctrl-C at every phase of a `quantkit` process, its shutdown included: one line, exit 130.

Each case runs `python -m quantkit.cli.main` (or another `python -m` program of quantkit) in a
fresh interpreter through a small wrapper (`WRAPPER`, written to the case's folder) that sends
the process SIGINT itself, at a fixed point of its life instead of after a sleep, so a case
lands where it says however loaded the machine is:

- first: as the import of a module starts ("torch", imported inside the CLI's error boundary),
  from a meta path finder that removes itself; or as the Nth call of a function starts
  ("MODULE:QUALNAME#N"), from a profile hook that removes itself;
- then, once the program has answered: while its one line is printed ("answer"), after `main`
  returned ("exit"), while the interpreter joins a non-daemon thread ("threads"), inside an
  `atexit` callback ("atexit", where torch's finalizer was hit), or in an object's `__del__`
  during interpreter finalization ("finalize").

Every SIGINT the wrapper sends is written to a marker file first, so a case that never reached
its phase fails instead of passing without having sent anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sigint_hook import sigint_hook_source

INTERRUPTED = 130
NOTHING_WRITTEN = "interrupted; nothing was written"

WRAPPER = (
    sigint_hook_source()
    + r'''
import atexit, os, runpy, signal, sys, threading

FIRST, THEN = os.environ["QK_SIGINT_FIRST"], os.environ["QK_SIGINT_THEN"]
MODULE, MARK = os.environ["QK_SIGINT_MODULE"], sys.argv.pop(1)
MAIN = threading.main_thread()


def ctrl_c(why, pthread_kill=signal.pthread_kill, ident=MAIN.ident, sig=signal.SIGINT, mark=MARK,
           open=open):
    # Bound as defaults: `__del__` runs while the interpreter tears its modules (and this
    # module's builtins) down.
    with open(mark, "a") as fh:
        fh.write(why + "\n")
    pthread_kill(ident, sig)  # to the main thread, where Python runs its signal handlers


class CtrlCOnImport:
    """SIGINT as the import of module FIRST starts (a meta path finder asked first)."""

    def find_spec(self, name, path=None, target=None):
        if name == FIRST:
            sys.meta_path.remove(self)
            if THEN == "answer":  # armed now: a warning's line before this is not the answer
                at_call("__main__:_say", ctrl_c)  # run by runpy, the CLI's module is __main__
            ctrl_c(f"import {name}")
        return None


class Late:
    def __del__(self):
        ctrl_c("finalize")


def when_main_stops():
    while MAIN.is_alive():  # waits for a state, not a time: the thread joins come after it
        threading.Event().wait(0.02)
    ctrl_c("threads")


if ":" in FIRST:
    at_call(FIRST, ctrl_c)
elif FIRST:
    sys.meta_path.insert(0, CtrlCOnImport())
if THEN == "atexit":
    atexit.register(ctrl_c, "atexit")  # registered first, so run last: after torch's own
if THEN == "threads":
    threading.Thread(target=when_main_stops).start()
if THEN == "finalize":
    late = Late()
try:
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
finally:
    if THEN == "exit":
        ctrl_c("exit")
'''
)


@dataclass(frozen=True)
class Interrupted:
    code: int
    out: str
    err: str
    sent: list[str]  # the SIGINTs the wrapper sent, in order


def run_interrupted(
    *args: str | Path,
    folder: Path,
    first: str = "",
    then: str = "",
    module: str = "quantkit.cli.main",
    timeout_s: float = 300,
) -> Interrupted:
    """`python -m MODULE ARGS` in a fresh interpreter, with SIGINT at `first` (a module whose
    import starts, or "MODULE:QUALNAME[#N]", a call that starts; "": none) and then in
    shutdown phase `then` ("": none)."""
    wrapper, mark = folder / "ctrl_c.py", folder / "sent.txt"
    wrapper.write_text(WRAPPER)
    mark.unlink(missing_ok=True)
    home = folder / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, QUANTKIT_HOME=str(home), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.update(HF_HOME=str(home / "hf"), QK_SIGINT_FIRST=first, QK_SIGINT_THEN=then)
    env["QK_SIGINT_MODULE"] = module
    proc = subprocess.run(
        [sys.executable, str(wrapper), str(mark), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=timeout_s,
    )
    sent = mark.read_text().splitlines() if mark.is_file() else []
    return Interrupted(proc.returncode, proc.stdout, proc.stderr, sent)


def _quiet(ran: Interrupted) -> None:
    assert "Traceback" not in ran.err, ran.err
    assert "Exception ignored" not in ran.err, ran.err


SHUTDOWN = ["answer", "exit", "threads", "atexit", "finalize"]


@pytest.mark.parametrize("then", SHUTDOWN)
def test_a_second_ctrl_c_while_the_cli_ends_is_ignored(tmp_path: Path, then: str) -> None:
    """The first Ctrl-C lands in torch's import (inside the error boundary); the second in
    shutdown phase `then`: still exit 130 and the one line, nothing after it."""
    ran = run_interrupted("inspect", tmp_path, folder=tmp_path, first="torch", then=then)
    assert ran.sent == ["import torch", then if then != "answer" else "__main__:_say"]
    _quiet(ran)
    assert ran.code == INTERRUPTED, (ran.code, ran.err)
    assert ran.err.strip() == NOTHING_WRITTEN, ran.err


def test_a_ctrl_c_in_atexit_after_a_finished_command_is_ignored(tmp_path: Path) -> None:
    """The command finished (the case that failed: torch's atexit finalizer was interrupted):
    the late Ctrl-C changes nothing, exit 0 and nothing on stderr."""
    ran = run_interrupted("--version", folder=tmp_path, then="atexit")
    assert ran.sent == ["atexit"]
    _quiet(ran)
    assert ran.code == 0 and ran.err == "", (ran.code, ran.err)
    assert "quantkit" in ran.out


def test_an_in_process_caller_gets_its_sigint_handler_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Only the process's entry point (`main()`, no argv) leaves SIGINT ignored: a caller that
    passes argv carries on afterwards, Ctrl-C and all."""
    import signal

    from quantkit.cli.main import main

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as done:
        main(["--no-such-option"])
    assert done.value.code == 2 and "No such option" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before
    main(["--version"])
    assert signal.getsignal(signal.SIGINT) is before
