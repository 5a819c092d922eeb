"""The chaos soak's short form (bench/chaos.py): a tiny sync run whose parts are SIGKILLed three
times at seeded random moments and resumed each time, then audited from its records and its Redis
stream (every step once, versions increasing, no rollout trained twice, every entry's draw
published once, skipped prompts within the in-flight bound, resumed workers caught up first).

The seed is drawn from `random` and printed; CHAOS_SEED=N replays one schedule. The long form
(`python bench/chaos.py --kills 50`) is a bench, run on demand (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import chaos


@pytest.mark.slow
def test_three_random_kills_lose_nothing_and_train_nothing_twice(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(2**31)))
    print(f"kill schedule: CHAOS_SEED={seed}")
    plan = chaos.schedule(3, seed, "reference")
    steps = 20  # enough that the three kills land before the last step, short enough for the suite
    ran = chaos.soak(tmp_path / "run", plan, steps, "sync", "reference", seed)
    assert all(k["left_behind"] == 0 for k in ran["kills"]), ran["kills"]
    assert sum(k["what"].startswith("killed") for k in ran["kills"]) >= 2, ran["kills"]
    assert ran["final_exit"] in (0, None), (tmp_path / "run.launcher.log").read_text()[-3000:]
    result = chaos.audit(tmp_path / "run", steps, 4, 2, len(ran["kills"]), in_flight=2)
    assert result["passed"], result["checks"]


@pytest.mark.slow
def test_a_launcher_killed_before_its_config_is_started_again_not_resumed(tmp_path: Path) -> None:
    """A launcher killed at once has written no config.toml, so `--resume` has nothing to read (it
    exits 2 and says so); the soak starts the run again with its first command, which then trains
    to the end (CHAOS_SEED=1725270212 drew this kill first, and every later launch failed)."""
    out = tmp_path / "run"
    ran = chaos.soak(out, [chaos.Kill("launcher", False, 0.0)], 2, "sync", "reference", 3)
    assert ran["kills"][0]["what"] == "killed the launcher at checkpoint 0", ran["kills"]
    assert ran["final_exit"] == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    result = chaos.audit(out, 2, 4, 2, 1, in_flight=2)
    assert result["passed"], result["checks"]


def test_a_kill_due_after_the_last_kill_checkpoint_comes_at_it(tmp_path: Path) -> None:
    """At checkpoint 17 of 20 neither a 20 s delay nor "after the next checkpoint" may be waited
    for: the last steps could end the run first (CHAOS_SEED=1008537025 lost its second kill so)."""
    assert chaos.KILL_MARGIN_STEPS == 3
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("step_00000017")
    for kill in (chaos.Kill("launcher", False, 20.0), chaos.Kill("launcher", True, 20.0)):
        stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(40)"])  # a launcher
        started = time.monotonic()
        assert (
            chaos.strike(kill, stand_in, tmp_path, "no-marker", 20) == "killed the launcher at checkpoint 17"
        )
        assert stand_in.wait(10) == -signal.SIGKILL
        assert time.monotonic() - started < 10, kill


def test_a_kill_comes_at_most_its_share_of_the_steps_after_its_launch_began(tmp_path: Path) -> None:
    """A kill due 30 s after its launch, on a box that trains fast, comes once the run is
    `per_launch` checkpoints past where the launch began, not 30 s later: `--kills 50` on a fast
    box finished its 410 steps with 30 kills made."""
    latest = tmp_path / "checkpoints" / "LATEST"
    latest.parent.mkdir()
    latest.write_text("step_00000005")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a launcher
    advance = subprocess.Popen(  # the run trains on: checkpoint 13 (5 + 8) a second later
        [
            sys.executable,
            "-c",
            f"import time; time.sleep(1); open({str(latest)!r}, 'w').write('step_00000013')",
        ]
    )
    started = time.monotonic()
    what = chaos.strike(chaos.Kill("launcher", False, 30.0), stand_in, tmp_path, "no-marker", 100, 8)
    assert what == "killed the launcher at checkpoint 13"
    assert stand_in.wait(10) == -signal.SIGKILL
    assert time.monotonic() - started < 15
    assert advance.wait(10) == 0


def test_the_launch_after_a_kill_resumes_only_a_run_that_wrote_its_config(tmp_path: Path) -> None:
    first = chaos.next_launch(tmp_path, 5, "sync", "reference", 1)
    assert first == chaos.run_flags(tmp_path, 5, "sync", "reference", 1)
    (tmp_path / "config.toml").write_text("")
    assert chaos.next_launch(tmp_path, 5, "sync", "reference", 1) == [
        "--resume",
        str(tmp_path),
        "--tracker",
        "none",
    ]


@pytest.mark.slow
def test_sync_resume_after_lost_versions_trains_the_uninterrupted_runs_prompts(tmp_path: Path) -> None:
    """The trainer is killed after it published versions that no checkpoint holds (no checkpoint
    before the end; killed after step 3): those versions are lost, and the groups sampled from
    them, or from the restored version renumbered beyond max_lag, would be dropped. A sync resume
    removes them and draws their prompts again: the trained draws equal an uninterrupted run's."""
    import uuid

    def flags(out: Path) -> list[str]:
        args = chaos.run_flags(out, 10, "sync", "reference", 7)
        args[args.index("--trainer.checkpoint_every") + 1] = "0"  # only at the end
        return args

    out, log = tmp_path / "run", tmp_path / "run.log"
    marker = uuid.uuid4().hex
    proc = chaos.launch(flags(out), marker, log)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    os.kill(chaos.find_part(marker, "serve trainer"), signal.SIGKILL)
    assert proc.wait(120) == 1 and chaos.wait_gone(marker) == []
    marker = uuid.uuid4().hex
    assert chaos.launch(["--resume", str(out), "--tracker", "none"], marker, log).wait(1100) == 0, (
        log.read_text()[-3000:]
    )
    assert chaos.wait_gone(marker) == []
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "sync resume: rollouts the restored weights cannot train were removed" in trainer_log
    resumed = chaos.audit(out, 10, 4, 2, 1, in_flight=2)
    assert resumed["passed"], resumed["checks"]
    # An uninterrupted sync run that publishes every draw (skip_zero_variance false) trains its one
    # worker's draws 0..19 in order (measured with chaos.soak and no kills; `bench/chaos.py
    # --uninterrupted` compares a killed run with a real uninterrupted one). Without the redraw the
    # resumed run trains later draws in place of the lost ones.
    assert resumed["trained_draws"] == [f"worker0:{i}" for i in range(20)], resumed["trained_draws"]


def _run_dir(tmp_path: Path, log: str, checkpoint: int) -> Path:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rollout0.log").write_text(log)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text(f"step_{checkpoint:08d}")
    return tmp_path


def _went_on_after(run_dir: Path, events: list[str | int]) -> str:
    """`chaos.went_on` on a live launch while the service and trainer do `events` in order, 0.3 s
    apart: a str is appended to the rollout log, an int becomes the latest checkpoint."""
    import threading

    launch = subprocess.Popen(["sleep", "60"])

    def service_and_trainer() -> None:
        for event in events:
            time.sleep(0.3)
            if isinstance(event, int):
                (run_dir / "checkpoints" / "LATEST").write_text(f"step_{event:08d}")
            else:
                with open(run_dir / "logs" / "rollout0.log", "a") as log:
                    log.write(event)

    try:
        threading.Thread(target=service_and_trainer, daemon=True).start()
        return chaos.went_on(launch, run_dir, timeout_s=10.0)
    finally:
        launch.kill()


def test_an_engine_core_kill_counts_as_recovered_after_a_restart_and_a_later_checkpoint(
    tmp_path: Path,
) -> None:
    # A restart logged before the kill, and a checkpoint the trainer reaches on its backlog alone, do
    # not count: only a checkpoint after the restart that follows the kill does.
    run_dir = _run_dir(tmp_path, "engine restarted in 9.0s at v2\n", checkpoint=3)
    what = _went_on_after(run_dir, [4, "engine restarted in 1.2s at v5\n", 5])  # 4: the backlog
    assert what.startswith("engine restarted; the run went on to checkpoint 5"), what


def test_an_engine_core_kill_without_a_restart_is_not_recovered(tmp_path: Path) -> None:
    import threading

    run_dir = _run_dir(tmp_path, "", checkpoint=3)
    launch = subprocess.Popen(["sleep", "60"])
    try:
        assert chaos.went_on(launch, run_dir, timeout_s=1.0).startswith("NOT RECOVERED")
    finally:
        launch.kill()
    # The kill hit the first engine start: the service logs vLLM's error and exits, then the launch ends.
    ending = subprocess.Popen(["sleep", "0.6"])

    def failed_start() -> None:
        time.sleep(0.2)
        with open(run_dir / "logs" / "rollout0.log", "a") as log:
            log.write("RuntimeError: Engine core initialization failed. See root cause above.\n")

    threading.Thread(target=failed_start, daemon=True).start()
    assert "first engine start" in chaos.went_on(ending, run_dir, timeout_s=10.0)


def test_an_engine_core_killed_during_its_first_start_counts_once_started_again(tmp_path: Path) -> None:
    # The service's first start failed and was retried ("engine start failed"), then loaded: a
    # checkpoint after that is recovery. A failed start with no load after it is not.
    run_dir = _run_dir(tmp_path, "", checkpoint=0)
    events: list[str | int] = [
        "vllm engine loaded in 1.0s\nengine start failed (killed); starting it again in 1.0s\n",
        1,  # before the second load
        "vllm engine loaded in 21.0s; serving weight version 0\n",
        2,
    ]
    what = _went_on_after(run_dir, events)
    assert what.startswith("engine killed during its first start, started again; the run went on to "
                           "checkpoint 2"), what  # fmt: skip
