"""trainer.agent: torchrun's real agent, ending a signal stop with rank 0's recorded exit status.

Plain torchrun exits 1 with a SignalException traceback after any SIGTERM, whatever its ranks did.
These run the real agent (`python -m trainer.agent --standalone ...`) over one tiny rank
(tests/agent_rank.py) and SIGTERM it, as a supervisor stops the trainer service; the two-rank
trainer service's own stop is in tests/test_trainer_multirank.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.listeners import listening, off_loopback
from trainer.agent import (
    EXIT_FILE_ENV,
    SHUTDOWN_TIMEOUT_ENV,
    SHUTDOWN_TIMEOUT_S,
    rank0_exit,
    remove_orphaned_scratch,
)

ROOT = Path(__file__).resolve().parents[1]


def start_agent(
    tmp_path: Path, mode: str, name: str = "agent", extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    ready, log = tmp_path / f"{name}.ready", tmp_path / f"{name}.log"
    scratch_parent = tmp_path / "tmp"  # TMPDIR: where the agent keeps its scratch directory
    scratch_parent.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (EXIT_FILE_ENV, SHUTDOWN_TIMEOUT_ENV)}
    env |= {"TMPDIR": str(scratch_parent), **(extra_env or {})}
    command = [
        sys.executable, "-m", "trainer.agent", "--standalone", "--nproc-per-node=1", "--max-restarts=0",
        "--monitor-interval=0.5", "-m", "tests.agent_rank", mode, str(ready),
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return proc, log


def stop(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(log.read_text()[-3000:]) from None
    return rc, log.read_text()


@pytest.mark.parametrize("recorded", [0, 3])
def test_a_signal_stop_exits_with_what_rank_0_recorded(tmp_path: Path, recorded: int) -> None:
    proc, log = start_agent(tmp_path, str(recorded))
    rc, text = stop(proc, log)
    assert rc == recorded, text[-3000:]
    assert f"stopped by SIGTERM: rank 0 exited {recorded}" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_the_agents_rendezvous_store_listens_on_loopback_only(tmp_path: Path) -> None:
    """torchrun's own --standalone store listens on every interface and holds a pickle the agent
    loads: the agent serves its store on 127.0.0.1 instead (trainer/local_rendezvous.py)."""
    proc, log = start_agent(tmp_path, "0")
    try:
        pids = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
        held = [(pid, address, port) for pid in pids for address, port in listening(pid)]
        print("listening:", held)
        assert any(pid == proc.pid for pid, _, _ in held), (held, log.read_text()[-3000:])  # the store
        assert off_loopback(pids) == [], log.read_text()[-3000:]
    finally:
        rc, text = stop(proc, log)
    assert rc == 0, text[-3000:]


def test_standalone_becomes_the_loopback_rendezvous_only_among_torchruns_own_arguments() -> None:
    from trainer.local_rendezvous import replace_standalone

    assert replace_standalone(["--standalone", "--nproc-per-node=2", "-m", "x", "--standalone"]) == [
        "--rdzv-backend=parity-local", "--rdzv-endpoint=127.0.0.1:0", "--nnodes=1", "--nproc-per-node=2",
        "-m", "x", "--standalone",
    ]  # fmt: skip
    assert replace_standalone(["--nproc-per-node=2", "script.py", "--standalone"]) == [
        "--nproc-per-node=2", "script.py", "--standalone",
    ]  # fmt: skip


def test_ranks_across_hosts_keep_their_rendezvous_and_gloo_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Kubernetes overlays: a static rendezvous across pods; gloo must not be pinned to lo there.
    from trainer.local_rendezvous import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV, use

    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)
    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    argv = ["--nnodes=2", "--rdzv-backend=static", "--rdzv-endpoint=trainer-0:29400", "-m", "x"]
    assert use(argv) == argv
    assert GLOO_IFNAME_ENV not in os.environ and NCCL_IFNAME_ENV not in os.environ
    assert use(["--standalone", "-m", "x"])[0] == "--rdzv-backend=parity-local"
    assert os.environ[GLOO_IFNAME_ENV] == "lo" and os.environ[NCCL_IFNAME_ENV] == "lo"
    # a choice the user made stands
    monkeypatch.setenv(NCCL_IFNAME_ENV, "ib0")
    use(["--standalone", "-m", "x"])
    assert os.environ[NCCL_IFNAME_ENV] == "ib0"


def test_the_agent_waits_longer_than_torchruns_30_s_for_a_graceful_stop(tmp_path: Path) -> None:
    """Rank 0's graceful stop (finish the step, publish, checkpoint) outlasts torchrun's default 30 s
    on a real model: the agent's ranks run under a longer shutdown timeout, unless one is set."""
    for extra, expected in (({}, str(SHUTDOWN_TIMEOUT_S)), ({SHUTDOWN_TIMEOUT_ENV: "77"}, "77")):
        name = f"agent{expected}"
        proc, log = start_agent(tmp_path, "0", name=name, extra_env=extra)
        try:
            assert (tmp_path / f"{name}.shutdown_timeout").read_text() == expected
        finally:
            assert stop(proc, log)[0] == 0
    assert SHUTDOWN_TIMEOUT_S > 30


def test_a_rank_0_that_recorded_nothing_fails_the_stop_saying_so(tmp_path: Path) -> None:
    proc, log = start_agent(tmp_path, "unrecorded")
    rc, text = stop(proc, log)
    assert rc == 1, text[-3000:]
    assert "rank 0 exited without an exit status" in text, text[-3000:]


def test_sigusr1_dumps_the_agents_stacks_and_it_goes_on(tmp_path: Path) -> None:
    proc, log = start_agent(tmp_path, "0")
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    # faulthandler heads the thread that took the signal "Current thread", but the kernel may hand
    # SIGUSR1 to a thread with no Python frames (the agent's store), and then every Python thread
    # is headed "Thread". The main thread's stack ends in runpy's module entry (`-m`): a full dump.
    while "in _run_module_as_main" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    assert "(most recent call first)" in log.read_text()
    assert proc.poll() is None
    rc, text = stop(proc, log)
    assert rc == 0, text[-3000:]


def test_rank0_exit_reads_only_a_recorded_status(tmp_path: Path) -> None:
    path = tmp_path / "rank0.exit"
    assert rank0_exit(path) is None
    path.write_text("garbage\n")
    assert rank0_exit(path) is None
    path.write_text("0\n")
    assert rank0_exit(path) == 0


def test_an_agent_removes_the_scratch_left_by_a_sigkilled_one(tmp_path: Path) -> None:
    killed, _ = start_agent(tmp_path, "0", name="killed")
    (left,) = (tmp_path / "tmp").glob(f"parity-agent-{killed.pid}-*")
    # torchrun starts its rank in a session of its own: the group kill below leaves it running
    ranks = psutil.Process(killed.pid).children(recursive=True)
    os.killpg(killed.pid, signal.SIGKILL)  # the agent: nothing can clean up
    killed.wait(30)
    for rank in ranks:  # what a node's shutdown would end; left running, it outlived the suite
        with contextlib.suppress(psutil.Error):
            rank.kill()
    assert left.is_dir()
    proc, log = start_agent(tmp_path, "0", name="next")
    try:
        assert not left.exists(), log.read_text()[-3000:]
        assert len(list((tmp_path / "tmp").glob(f"parity-agent-{proc.pid}-*"))) == 1
    finally:
        rc, text = stop(proc, log)
    assert rc == 0, text[-3000:]
    assert not list((tmp_path / "tmp").iterdir())  # and its own went with it


def test_only_the_scratch_of_agents_no_longer_running_is_removed(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f"parity-agent-{int(gone.stdout)}-abc"
    live = tmp_path / f"parity-agent-{os.getpid()}-def"
    other = tmp_path / "parity-agent-notapid-ghi"
    for path in (dead, live, other):
        path.mkdir()
    assert remove_orphaned_scratch(tmp_path) == [dead]
    assert live.is_dir() and other.is_dir() and not dead.exists()
