"""A multiprocessing child of a parity service dies with the service (parity.procs), on real processes.

vLLM's engine core is such a child. With the `spawn` start method (vLLM's choice on CPU) it imports
`commands.main` as its main module and asks the kernel for SIGKILL when its parent dies; that path is
checked with a real engine in tests/test_engine_recovery.py. Here the `fork` path
(`children_die_with_this_process`, vLLM's default where nothing forces spawn): a parent forks a
sleeping child through multiprocessing, the parent alone is SIGKILLed, the child must be gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

PARENT = """
import multiprocessing, sys, time
from parity import procs
if sys.argv[1] == "hook":
    procs.children_die_with_this_process()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
print(child.pid, flush=True)
time.sleep(60)
"""


def forked_child_outlives_its_killed_parent(hook: bool) -> bool:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "hook" if hook else "none"], stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
                    return False
            time.sleep(0.05)
        return True
    finally:
        parent.kill()
        if child is not None:
            with contextlib.suppress(psutil.Error):
                child.kill()


def test_a_forked_child_dies_with_its_parent() -> None:
    assert not forked_child_outlives_its_killed_parent(hook=True)


def test_without_the_hook_a_forked_child_outlives_its_parent() -> None:
    # the control: what the hook prevents (the child is reparented and sleeps on)
    assert forked_child_outlives_its_killed_parent(hook=False)
