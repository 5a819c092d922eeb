"""A launcher killed with SIGKILL takes its children with it (parity.procs, die_with_launcher).

A stand-in launcher (a real Python process using the same parity.procs calls as `parity run`'s
supervisor) starts a private redis-server and a real broadcast service, prints their pids, and
waits. The test SIGKILLs it and watches the pids. The control starts the same children without
the setting: they outlive their launcher (the defect this guards against), and are cleaned up here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

LAUNCHER = textwrap.dedent(
    """
    import json, sys, time
    from parity.procs import start_redis, start_service

    log_dir, dies = sys.argv[1], sys.argv[2] == "1"
    redis, _url = start_redis(log_dir, die_with_launcher=dies)
    service = start_service("broadcast", [], log_dir=log_dir, name="broadcast", die_with_launcher=dies)
    service.wait_ready(240)
    print(json.dumps({"redis": redis.proc.pid, "broadcast": service.proc.pid}), flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _launch_and_kill(tmp_path: Path, dies: bool) -> dict[str, int]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), "1" if dies else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = launcher.stdout.readline()
        assert line, f"the stand-in launcher exited with {launcher.wait(5)} before starting its children"
        pids = json.loads(line)
        assert all(_alive(pid) for pid in pids.values()), pids
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_of_a_sigkilled_launcher_die_with_it(tmp_path: Path) -> None:
    pids = _launch_and_kill(tmp_path, dies=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids.values()):
        time.sleep(0.1)
    left = {name: pid for name, pid in pids.items() if _alive(pid)}
    for pid in left.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert not left, f"still running 10 s after their launcher was SIGKILLed: {left}"


def test_control_without_the_setting_children_outlive_the_launcher(tmp_path: Path) -> None:
    pids = _launch_and_kill(tmp_path, dies=False)
    try:
        time.sleep(2)
        assert all(_alive(pid) for pid in pids.values()), pids
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # each leads its own process group


def test_a_child_whose_launcher_is_already_gone_does_not_start(tmp_path: Path) -> None:
    """The shim checks the parent after the prctl: a launcher that died first leaves nothing."""
    from parity.procs import _exec_dying_with

    cmd = _exec_dying_with([sys.executable, "-c", "print('started')"], True)
    cmd[cmd.index(str(os.getpid()))] = "1"  # a launcher pid that is not the parent
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "started" not in result.stdout
