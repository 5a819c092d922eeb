"""Processes that die with their parent (parity.procs.die_with_parent) when the parent is pid 1.

In a container the entrypoint is pid 1: `parity serve rollout` (vLLM's engine core is its child),
Parity's torchrun agent or plain `torchrun` (the trainer ranks are its children). A child whose
parent is pid 1 used to take itself for an orphan adopted by init and exit 1 at start. A parent
that is pid 1 now says so (`mark_as_parent`), and a rank checks whether pid 1 is a torchrun agent.
The container is a new user and pid namespace (`unshare -Urpf --mount-proc`) with its own /proc.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.procs import parent_is_gone

ROOT = Path(__file__).resolve().parents[1]


def test_a_parent_pid_of_1_is_an_orphans_unless_the_parent_marked_itself_pid_1() -> None:
    assert not parent_is_gone(before=4321, now=4321, marked=None)
    assert parent_is_gone(before=4321, now=1, marked=4321)  # died between the two reads
    assert parent_is_gone(before=1, now=1, marked=None)  # adopted by init before the first read
    assert parent_is_gone(before=1, now=1, marked=4321)  # the mark of a parent that has died
    assert not parent_is_gone(before=1, now=1, marked=1)  # a container's entrypoint


def _container(*argv: str) -> subprocess.CompletedProcess:
    unshare = shutil.which("unshare")
    probe = [unshare, "-Urpf", "--mount-proc", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
        pytest.skip("this host cannot create user and pid namespaces (unshare -Urpf --mount-proc)")
    return subprocess.run(
        [unshare, "-Urpf", "--mount-proc", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("agent", ["trainer.agent", "torch.distributed.run"])
def test_a_trainer_rank_lives_under_a_torchrun_agent_that_is_pid_1(agent: str) -> None:
    done = _container(
        sys.executable,
        "-m",
        agent,
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "tests.fakes.die_with_agent_probe",
    )
    assert done.returncode == 0 and "rank alive" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


_PID_1 = """
import os, subprocess, sys
from parity import procs
assert os.getpid() == 1, os.getpid()
if sys.argv[1] == "mark":
    procs.children_die_with_this_process()  # what `parity serve rollout` does before its engine starts
child = subprocess.run(
    [sys.executable, "-c", "from parity.procs import die_with_parent; die_with_parent(); print('alive')"],
    capture_output=True, text=True,
)
print(child.returncode, child.stdout.strip())
"""


@pytest.mark.parametrize(("mode", "child"), [("mark", "0 alive"), ("no-mark", "1")])
def test_a_child_of_pid_1_lives_when_pid_1_marked_itself_its_parent(mode: str, child: str) -> None:
    done = _container(sys.executable, "-c", _PID_1, mode)
    assert done.returncode == 0 and done.stdout.strip() == child, done.stdout + done.stderr[-3000:]


@pytest.mark.slow
def test_a_rollout_service_that_is_a_containers_pid_1_starts_its_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`parity serve rollout` as a container's entrypoint (pid 1, as in docker-compose.yml): vLLM's
    engine core, its child, starts and the service generates. Before, the engine core exited 1 at
    start and the service never served."""
    import grpc

    from parity import health
    from parity.ports import free_port
    from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    _container(sys.executable, "-c", "pass")  # skips where namespaces cannot be made
    port = free_port()
    argv = ["unshare", "-Urpf", "--mount-proc", "--kill-child=SIGKILL", sys.executable, "-m", "commands.main"]
    argv += ["serve", "rollout", "--model", str(tiny_model), "--port", str(port)]
    log = tmp_path / "rollout.log"
    with log.open("wb") as out:  # unshare ignores SIGTERM: the test signals the session instead
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a vLLM start, on a loaded box
        while health.check(f"127.0.0.1:{port}") != (True, "SERVING"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "not SERVING in 600 s"
            time.sleep(0.5)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
                rollout_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7],
                    sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=4),
                ),
                timeout=120,
            )
        assert len(reply.completions[0].token_ids) == 4
        os.killpg(proc.pid, signal.SIGTERM)  # the service, pid 1 inside, stops as under `docker stop`
        assert proc.wait(120) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
