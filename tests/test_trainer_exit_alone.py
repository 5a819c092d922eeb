"""A trainer restarted alone, with a rollout service restarted while it was down, trains its
remaining steps and exits 0 promptly (issue #37).

The restarted trainer resumes at the broadcast's latest version, so it publishes nothing before its
first step; the restarted rollout service serves version 0 and its actor generates nothing until it
is caught up to that version. Unless the trainer serves catch-ups of the version it restored, neither
moves: the trainer waits for rollouts forever and never reaches its last step.

Real processes throughout: a private redis-server, `parity serve broadcast`, `parity serve rollout
--engine reference --actor true` and `parity serve trainer` (real gloo), killed with SIGKILL.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from parity.procs import ServiceProcess

TOKEN = "exit-alone-token"
STEPS = 4
KILLED_AFTER_CHECKPOINT = "trainer.loop: checkpoint step_00000002"
# restarted trainer: load, catch the worker up, two steps; it hung forever. Two cold services start
# at once inside this bound, so it is sized for a slow box (a hang still fails it).
FINISH_BOUND_S = 600.0
EXIT_AFTER_DONE_S = 30.0  # after its last step


def _wait_for(service: ServiceProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in service.log_path.read_text(errors="replace"):
        assert service.alive(), f"{service.name} exited:\n{service.log_tail()}"
        assert time.monotonic() < deadline, (
            f"{service.name}: no {text!r} in {timeout_s:.0f}s:\n{service.log_tail()}"
        )
        time.sleep(0.1)


def _kill(service: ServiceProcess) -> None:
    service.signal(signal.SIGKILL)
    service.proc.wait(10)


def test_restarted_trainer_catches_up_a_restarted_worker_and_exits_after_its_last_step(
    start_services: Callable[..., ServiceProcess], redis_url: str, tmp_path: Path
) -> None:
    broadcast = start_services(
        "broadcast",
        "--auth_token",
        TOKEN,
        "--heartbeat_timeout_s",
        "30",
        env={"PARITY_RUN_REDIS_URL": redis_url},
    )
    common = ("--model", "tiny", "--groups_per_step", "1", "--group_size", "2", "--max_tokens", "4",
              "--max_lag", "1", "--broadcast_address", broadcast.address, "--auth_token", TOKEN)  # fmt: skip
    env = {"PARITY_RUN_REDIS_URL": redis_url}
    rollout_args = (*common, "--engine", "reference", "--actor", "true", "--worker_id", "w0")
    trainer_args = (
        *common,
        "--steps",
        str(STEPS),
        "--checkpoint_every",
        "1",
        "--run_dir",
        str(tmp_path / "run"),
    )
    rollout = start_services("rollout", *rollout_args, name="rollout1", env=env)
    trainer = start_services("trainer", *trainer_args, name="trainer1", env=env, wait=False)
    _wait_for(trainer, KILLED_AFTER_CHECKPOINT, 600)
    _kill(trainer)
    _kill(rollout)
    # the rollout service is SERVING only once caught up, which needs the trainer: start both
    start_services("rollout", *rollout_args, name="rollout2", env=env, wait=False)
    restarted = start_services("trainer", *trainer_args, name="trainer2", env=env, wait=False)
    start = time.monotonic()
    _wait_for(restarted, " done: ", FINISH_BOUND_S)
    done = time.monotonic()
    try:
        restarted.proc.wait(EXIT_AFTER_DONE_S)
    except Exception:
        raise AssertionError(f"trainer still running {EXIT_AFTER_DONE_S:.0f}s after its last step") from None
    log = restarted.log_path.read_text(errors="replace")
    assert restarted.proc.returncode == 0, log[-3000:]
    assert f"done: step {STEPS}," in log
    assert "catch-up: v" in log  # the restarted worker got the restored version from this trainer
    print(f"restarted trainer: done after {done - start:.1f}s, exited {time.monotonic() - done:.1f}s later")
