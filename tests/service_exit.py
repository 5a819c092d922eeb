"""Waiting for a service to exit (signalled, or at the end of its work), with the evidence when it
does not.

A bare `proc.wait(N)` that runs out raises TimeoutExpired before the assertion's message (the
service's log) is ever built, so a red CI run said only "timed out after 60 seconds". Here a
service still running at the deadline gets SIGUSR1 first (`parity.stack_dumps`:
every Python thread's stack goes to its log), and the failure carries the log's tail with them.
"""

from __future__ import annotations

import signal
import subprocess
import time

from parity.procs import ServiceProcess


def exit_code(service: ServiceProcess, timeout_s: float, lines: int = 150) -> int:
    """The service's exit code once it exits within `timeout_s`; an AssertionError naming the
    seconds waited, with its threads' stacks and its log's tail, if it does not."""
    started = time.monotonic()
    try:
        return service.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        service.proc.send_signal(signal.SIGUSR1)
        time.sleep(3.0)  # faulthandler writes the stacks from the signal handler: time to land in the log
        raise AssertionError(
            f"{service.name} still running {time.monotonic() - started:.0f}s after the wait began "
            f"(limit {timeout_s:.0f}s); its stacks and log:\n{service.log_tail(lines)}"
        ) from None
