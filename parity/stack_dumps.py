"""Python stack dumps on demand and at a native crash, for every Parity process that serves.

`kill -USR1 PID` writes every Python thread's stack to the process's stderr (its log) and the
process goes on: how to see where a service or a run that seems stuck is waiting. A fatal signal
(SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL: a crash in native code) writes them too, before the
process dies, so its log says which Python call was running.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys


def dump_stacks_on_sigusr1() -> None:
    """Install both dumps on the process's own stderr (a caller may have replaced sys.stderr)."""
    stderr = sys.__stderr__
    if hasattr(signal, "SIGUSR1") and stderr is not None:
        # No file descriptor behind stderr (an embedding host): no stack dumps, nothing else lost.
        with contextlib.suppress(OSError, ValueError):
            faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
            faulthandler.enable(file=stderr, all_threads=True)
