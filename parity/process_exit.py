"""How a service process that has finished its work ends: flush, then exit without interpreter
teardown.

A finished trainer has written its checkpoint, published its last version, stopped its gRPC
server and closed its weight groups. What is left is CPython's finalisation, and native threads
still running in it (gloo's workers releasing the tensors of a finished collective, gRPC's
pollers) can need the GIL of an interpreter that is being torn down. CPython then ends such a
thread with `pthread_exit`, whose forced unwind through a C++ frame calls `std::terminate`: the
process dies with SIGABRT ("terminate called without an active exception") after it logged
success, and the launcher reports a finished run as a crashed trainer. torch's issue #190489 and PR
#179291 describe the same abort at exit with gloo.

So a service that returns from its work flushes what it would lose (pending trace spans, log
handlers, stdout and stderr) and calls `os._exit` with its exit code. Nothing it holds needs the
teardown: files are closed, connections are closed by the kernel, and child processes die with
their parent (`parity.procs.die_with_parent`).

A service whose stop can leave blocking calls running on its event loop's default executor (the
rollout service: a weight update waiting for a transfer group that never forms, up to the
rendezvous's timeout_s; an engine being built) runs its main coroutine with `serve_then_exit`.
`asyncio.run` would wait for every such thread before returning, so a stopped service held on for
minutes after it logged that it had stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn

from parity import tracing

log = logging.getLogger(__name__)


def exit_after_shutdown(rc: int) -> NoReturn:
    """Flush trace spans, log handlers, stdout and stderr, then end the process with `rc`, skipping
    interpreter teardown (see the module docstring). Only for a process whose work is finished."""
    try:
        tracing.shutdown()
    except Exception:  # a collector that is gone loses its spans; the exit code must not change
        log.warning("flushing trace spans at exit failed", exc_info=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or no descriptor behind it: nothing to flush
            pass
    os._exit(rc)


def serve_then_exit(main: Coroutine[Any, Any, int]) -> NoReturn:
    """Run a service's main coroutine on a new event loop and, once it returns an exit code (its
    orderly stop done), end the process with `exit_after_shutdown`, without waiting for threads
    still running on the loop's default executor (see the module docstring). An exception out of
    the coroutine is logged with its traceback and ends the process with 1, the same way."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        rc = loop.run_until_complete(main)
    except Exception:
        log.exception("service failed")
        rc = 1
    exit_after_shutdown(rc)
