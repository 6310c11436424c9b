"""A Ctrl-C at a chosen call, for the interrupt tests' child processes.

The children run with nothing of the test tree importable (a wrapper script in a temporary
folder, `python -c`), so the tests put this file's text into their scripts
(`sigint_hook_source()`) rather than import it: one hook, not a copy per test module.
"""

import sys
from pathlib import Path


def at_call(spec, fire):
    """fire(spec) as the Nth call of MODULE's QUALNAME starts, spec "MODULE:QUALNAME[#N]" (a
    profile hook that unsets itself before firing: one per run)."""
    where, _, nth = spec.partition("#")
    module, qualname = where.split(":")
    left = [int(nth or 1)]

    def hook(frame, event, arg):
        code = frame.f_code
        if (
            event == "call"
            and code.co_qualname == qualname
            and frame.f_globals.get("__name__") == module
        ):
            left[0] -= 1
            if not left[0]:
                sys.setprofile(None)
                fire(spec)

    sys.setprofile(hook)


def sigint_hook_source():
    """This file's text, to paste into a child's script (it defines `at_call`)."""
    return Path(__file__).read_text()
