"""`parity run --resume`: a killed run continues to the same lineage (issue 19).

The slow test is the acceptance test, chained to fit the suite budget: one tiny run (private Redis,
checkpoint every step) is SIGKILLed three times at random points after a checkpoint: first its
trainer child, then its Redis child, then the launcher alone (its children die with it:
parity.procs die_with_launcher), and resumed after each (the
three trackers join at the last resume and replay the lineage). The kill points come from a seed
drawn from the test's `random` and printed (RESUME_KILL_SEED=N replays one). At the end: every
rollout id in trained_rollouts.jsonl appears once, versions strictly increase across the kills, the
step count is the configured one, the run finished, the trackers hold metrics.jsonl, and no
process outlived any launch.

The fast tests pin the pieces: the config diff refusal, the Redis-side prompt position, the actor's
seek, dropping rollouts of lost versions, and `parity runs ls`.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import chaos
from commands.run import records
from parity.config import load, write_config
from parity.rollout_queue import RolloutQueue
from parity.v1 import common_pb2, rollouts_pb2

STEPS = 12


# --- fast -----------------------------------------------------------------------------------------
def _stored_run(tmp_path: Path, *flags: str, environ: dict[str, str] | None = None) -> Path:
    """A run directory as a killed launch leaves it: config.toml, config.json, a private Redis conf."""
    run_dir = tmp_path / "run"
    cfg = load(["--model", "tiny", "--steps", "4", *flags], home="run", environ=environ or {}).config
    write_config(cfg, run_dir / "config.toml")
    (run_dir / "config.json").write_text(json.dumps({"stream": cfg.run.stream}))
    (run_dir / "logs" / "redis").mkdir(parents=True)
    (run_dir / "logs" / "redis" / "redis.conf").write_text("appendonly yes\nrequirepass secret\n")
    return run_dir


def test_resume_refuses_a_changed_config_naming_every_key(tmp_path: Path) -> None:
    run_dir = _stored_run(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "commands.main", "run", "--resume", str(run_dir), "--trainer.lr", "1e-3",
         "--group_size", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PARITY_TASK_MAX_TOKENS": "9"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    for key in ("trainer.lr", "task.group_size", "task.max_tokens", "--resume_override"):
        assert key in proc.stderr, (key, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "run.json").exists()  # refused before anything started


def test_resume_plan_keeps_the_stream_and_takes_overrides(tmp_path: Path) -> None:
    from commands.run.resume import ResumeError, plan

    # config.toml holds the private Redis's URL masked (redis://:***@...); it must not be used
    run_dir = _stored_run(
        tmp_path, "--tracker", "none", environ={"PARITY_RUN_REDIS_URL": "redis://:pw@127.0.0.1:1/0"}
    )
    assert "***@" in (run_dir / "config.toml").read_text()
    same = plan(run_dir, ["--resume", str(run_dir), "--tracker", "tensorboard"], environ={})
    assert same.overrides == {} and same.redis_password == "secret" and same.step == 0
    assert same.config.run.redis_url == ""  # the run's own Redis is restarted, not the masked URL
    assert same.config.run.tracker == "tensorboard"  # trackers may change on resume
    changed = plan(run_dir, ["--resume", str(run_dir), "--steps", "6", "--resume_override"], environ={})
    assert changed.overrides == {"run.steps": (4, 6)} and changed.config.run.steps == 6
    (run_dir / "logs" / "redis" / "redis.conf").unlink()  # an external Redis: its URL is needed again
    with pytest.raises(ResumeError, match=r"^run\.redis_url: this run used an external Redis"):
        plan(run_dir, ["--resume", str(run_dir)], environ={})


def _group(group_id: str, versions: list[int]) -> rollouts_pb2.RolloutGroup:
    sample = rollouts_pb2.RolloutSample(
        rollout_id=f"{group_id}/0", token_ids=[5] * len(versions), logprobs=[-1.0] * len(versions),
        token_weight_versions=versions, reward=1.0,
    )  # fmt: skip
    return rollouts_pb2.RolloutGroup(
        group_id=group_id, prompt_token_ids=[1, 2], samples=[sample],
        min_weight_version=min(versions), max_weight_version=max(versions),
        sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8, n=1),
        logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED,
    )  # fmt: skip


def test_prompt_position_is_recorded_with_the_entry(redis_url: str) -> None:
    queue = RolloutQueue(redis_url, stream="test:positions")
    assert queue.producer_position("worker0") is None
    queue.publish(_group("a", [0]), position=("worker0", 4))
    queue.publish(_group("b", [0]), position=("worker0", 2))  # finished out of order: max kept
    queue.publish(_group("c", [0]), position=("worker1", 7))
    queue.publish(_group("d", [0]))  # no position: unchanged
    assert queue.producer_position("worker0") == 4 and queue.producer_position("worker1") == 7
    assert [f[b"group_id"] for _, f in queue.redis.xrange(queue.stream)] == [b"a", b"b", b"c", b"d"]


def test_sync_resume_draws_the_prompts_of_lost_versions_again(redis_url: str) -> None:
    """Entries the restored weights cannot train (lost versions, too stale) leave the stream and
    each producer's position moves back to just before its first such draw; trained entries,
    entries of kept versions and those below the floor stay."""
    queue = RolloutQueue(redis_url, stream="test:redraw")
    queue.ensure_group()
    published = [("w0", 0, [0]), ("w0", 1, [0]), ("w1", 0, [0]), ("w0", 2, [1]), ("w1", 1, [1, 2]),
                 ("w0", 3, [2]), ("w1", 2, [3])]  # fmt: skip
    ids = [queue.publish(_group(f"{p}-{d}", v), position=(p, d)) for p, d, v in published]
    first = queue.redraw_unusable(ids[1], [[2, 3]], stale_below=0, applied_groups=set())
    assert first == {"w1": 1, "w0": 3}
    left = [f[b"group_id"].decode() for _, f in queue.redis.xrange(queue.stream)]
    assert left == ["w0-0", "w0-1", "w1-0", "w0-2"]
    assert queue.producer_position("w0") == 2 and queue.producer_position("w1") == 0
    assert queue.redraw_unusable(ids[1], [[2, 3]], 0, set()) == {}  # nothing left to remove
    # too stale for the renumbered version, but already trained (w0-1) or below the floor (w0-0): kept
    assert queue.redraw_unusable(ids[1], [], stale_below=1, applied_groups={"w0-1"}) == {"w1": 0}
    assert [f[b"group_id"].decode() for _, f in queue.redis.xrange(queue.stream)] == ["w0-0", "w0-1", "w0-2"]
    assert queue.producer_position("w1") is None  # draws again from its first draw


def test_actor_continues_the_prompt_stream_where_it_stopped() -> None:
    from rollout.actor import Actor

    cfg = load(
        ["--model", "tiny", "--seed", "3", "--rollout.worker_index", "1", "--rollout_workers", "2"],
        home="run",
        environ={},
    ).config
    servicer = SimpleNamespace(engine=None)
    straight = Actor(cfg, servicer)
    drawn = [straight._next_prompt() for _ in range(12)]
    resumed = Actor(cfg, servicer)
    resumed.seek(7)
    assert [resumed._next_prompt() for _ in range(5)] == drawn[7:]
    assert resumed.producer == "worker1"


def test_rollouts_of_lost_versions_are_dropped_and_counted(redis_url: str, tmp_path: Path) -> None:
    """A trainer that restores version 0 while version 3 was published (local mode): versions 1-3
    are lost; a group with a token of version 2 is dropped, one of version 0 is trained."""
    from tests.fakes.trainer_helpers import STREAM, make_trainer, metrics

    (tmp_path / "published_version").write_text("3")
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(_group("lost", [0, 2]))
    queue.publish(_group("kept", [0, 0]))
    trainer = make_trainer(redis_url, tmp_path, max_lag=10)
    assert trainer.state.lost_versions == [[1, 3]]
    assert trainer.state.weight_version == 4  # the restored weights, re-published above the highest
    trainer.run()
    (row,) = metrics(tmp_path)
    assert row["dropped_future_version"] == 1 and row["dropped_future_version_total"] == 1
    assert row["weight_version"] == 4
    trained = json.loads((tmp_path / "trained_rollouts.jsonl").read_text())["rollout_ids"]
    assert trained == ["kept/0"]
    state = json.loads(next((tmp_path / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["lost_versions"] == [[1, 3]] and state["dropped_future_version_total"] == 1
    trainer.close()


def test_a_version_only_the_stream_saw_counts_as_published(redis_url: str, tmp_path: Path) -> None:
    """A trainer killed mid-publish: the workers got version 3 and sampled from it, but no record
    says 3 was published (file 2). The restarted trainer must not reuse 3 for its restored weights,
    or those rollouts would pass for on-policy: 3 is lost too, and the group is dropped."""
    from tests.fakes.trainer_helpers import STREAM, make_trainer, metrics

    (tmp_path / "published_version").write_text("2")
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(_group("foreign", [3, 3]))
    queue.publish(_group("kept", [0, 0]))
    trainer = make_trainer(redis_url, tmp_path, max_lag=10)
    assert trainer.state.lost_versions == [[1, 3]]
    assert trainer.state.weight_version == 4
    trainer.run()
    (row,) = metrics(tmp_path)
    assert row["dropped_future_version"] == 1
    assert json.loads((tmp_path / "trained_rollouts.jsonl").read_text())["rollout_ids"] == ["kept/0"]
    trainer.close()


def test_resumed_trainer_dropping_the_whole_backlog_does_not_stall_the_actor(
    redis_url: str, tmp_path: Path
) -> None:
    """The `--resume` deadlock: a trainer killed before its first checkpoint leaves 8 groups (4 of
    version 0, 4 of version 1) delivered to `trainer-0`. The restarted trainer restores version 0,
    re-publishes as 2 (version 1 lost), trains 2 groups of version 0 at step 1 and then drops the
    other 6 at step 2 (stale or lost). Held pending until a step that never comes, those 6 kept the
    actor's backlog at its bound (max_lag x groups_per_step = 4), so it produced nothing while the
    trainer waited. The producer here follows the actor's rule (`backlog_limit`)."""
    import threading

    from rollout.actor import backlog_limit
    from tests.fakes.trainer_helpers import STREAM, make_trainer, metrics

    (tmp_path / "published_version").write_text("1")
    queue = RolloutQueue(redis_url, stream=STREAM)
    for i, version in enumerate([0, 0, 0, 0, 1, 1, 1, 1]):
        queue.publish(_group(f"old{i}", [version, version]))
    dead = queue.read("trainer-0", count=8, block_ms=10)  # the killed trainer's reads ...
    queue.ack([e.entry_id for e in dead[:2]])  # ... and its step 1, never checkpointed
    # The groups' logprobs are made up, not a model's: the running gate would stop the trainer's
    # thread at step 2. This test is about the backlog, so the gate only warns.
    trainer = make_trainer(redis_url, tmp_path, steps=2, groups_per_step=2, max_lag=2, on_mismatch="warn")
    assert trainer.state.lost_versions == [[1, 1]] and trainer.state.weight_version == 2
    limit = backlog_limit(2, 2)
    stop = threading.Event()
    produced: list[str] = []

    def actor() -> None:
        producer = RolloutQueue(redis_url, stream=STREAM)
        while not stop.is_set():
            if producer.backlog() < limit:
                version = trainer.state.weight_version
                produced.append(f"new{len(produced)}")
                producer.publish(_group(produced[-1], [version, version]))
            stop.wait(0.05)

    threads = [threading.Thread(target=actor, daemon=True), threading.Thread(target=trainer.run, daemon=True)]
    for thread in threads:
        thread.start()
    threads[1].join(timeout=300)  # 2 steps: seconds on a normal box; over 60 s on one 2.5x slower
    stalled = threads[1].is_alive()
    if stalled:
        trainer.request_stop()
        threads[1].join(timeout=30)
    stop.set()
    threads[0].join(timeout=10)
    assert not stalled, (
        f"trainer stalled at step {trainer.state.step + 1}: backlog {queue.backlog()}, pending "
        f"{queue.redis.xpending_range(STREAM, 'trainer', '-', '+', 20)}, produced {produced}"
    )
    first, second = metrics(tmp_path)
    assert first["dropped_stale"] == first["dropped_future_version"] == 0
    assert second["dropped_stale"] == 2 and second["dropped_future_version"] == 4
    trained = [
        json.loads(line)["rollout_ids"]
        for line in (tmp_path / "trained_rollouts.jsonl").read_text().splitlines()
    ]
    assert trained[0] == ["old0/0", "old1/0"]
    assert set(trained[1]) <= {f"{g}/0" for g in produced} and len(trained[1]) == 2
    assert queue.pending() == 0  # everything read was used or dropped, and acknowledged
    trainer.close()


def test_runs_ls_shows_running_finished_and_died(tmp_path: Path) -> None:
    def run_dir(name: str, status: str, pid: int, steps_done: int) -> None:
        path = tmp_path / name
        path.mkdir()
        (path / "config.toml").write_text("")
        (path / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(1, steps_done + 1))
        )
        record = {"status": status, "steps": 4, "launches": [],
                  "launcher": {"pid": pid, "start_ticks": records._proc_start(pid)}}  # fmt: skip
        (path / "run.json").write_text(json.dumps(record))

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        run_dir("a-live", "running", sleeper.pid, 2)
        run_dir("b-done", "finished", 1, 4)
        run_dir("c-killed", "running", 2**22 + 17, 3)  # a SIGKILLed launcher: no such process
        run_dir("d-failed", "died", 1, 1)
        listed = {r["run"]: r for r in records.list_runs(tmp_path)}
    finally:
        sleeper.kill()
        sleeper.wait()
    assert {name: r["status"] for name, r in listed.items()} == {
        "a-live": "running", "b-done": "finished", "c-killed": "died at step 3", "d-failed": "died at step 1",
    }  # fmt: skip
    assert listed["b-done"]["reward_mean"] == 0.4 and listed["b-done"]["steps"] == 4
    out = subprocess.run(
        [sys.executable, "-m", "commands.main", "runs", "ls", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "died at step 3" in out.stdout and "b-done" in out.stdout


# --- slow: the acceptance test --------------------------------------------------------------------
def _flags(out: Path) -> list[str]:
    return ["--skip_preflight", "--model", "tiny", "--steps", str(STEPS), "--groups_per_step", "2",
        "--group_size", "4", "--max_tokens", "8", "--eval_size", "0", "--max_model_len", "256",
        "--startup_timeout_s", "900", "--trainer.checkpoint_every", "1", "--out", str(out),
        "--rollout.engine", "reference",
    ]  # fmt: skip


def _launch(args: list[str], marker: str, log_path: Path) -> subprocess.Popen:
    return chaos.launch(args, marker, log_path, {"WANDB_MODE": "offline", "WANDB_SILENT": "true"})


def _wait_checkpoint(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 240.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (done := chaos.checkpoint_step(run_dir)) < step:
        assert proc.poll() is None, f"launcher exited ({proc.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint {step} in {timeout_s:.0f}s"
        time.sleep(0.1)
    return done


def _child(marker: str, needle: str) -> int:
    pid = chaos.find_part(marker, needle)
    assert pid is not None, f"no live child matching {needle!r}"
    return pid


@pytest.mark.slow
def test_run_killed_three_ways_resumes_to_one_lineage(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    seed = int(os.environ.get("RESUME_KILL_SEED", random.randrange(2**31)))
    print(f"kill schedule: RESUME_KILL_SEED={seed}")
    rng = random.Random(seed)
    out, log_path = tmp_path / "run", tmp_path / "launcher.log"
    kills = [("trainer", "serve trainer"), ("redis", "redis-server"), ("launcher", "")]
    after = 0  # the checkpoint step the previous launch resumed from
    # The trackers join at the last resume (run.tracker may change on resume): their tracker run
    # replays the whole lineage (and the suite does not pay their start-up four times).
    launch_args = [*_flags(out), "--tracker", "none"]
    for index, (what, needle) in enumerate(kills):
        marker = uuid.uuid4().hex
        proc = _launch(launch_args, marker, log_path)
        # A resumed trainer first trains the stream's backlog, a step in well under a second, and
        # the parts take a moment to die: a kill lands up to ~3 steps after its checkpoint. Each
        # kill's target leaves 3 steps per kill still to come, so the last kill lands before the
        # run ends whatever the box's load (CI saw checkpoint 5 + 1.5 s become step 8 of 9).
        cap = STEPS - 3 * (len(kills) - index)
        target = max(after + 1, min(after + rng.randint(1, 2), cap))
        reached = _wait_checkpoint(out, target, proc)
        delay = rng.uniform(0.0, 0.6)
        time.sleep(delay)
        print(f"kill {what} after checkpoint {reached} (target {target}) + {delay:.2f}s")
        if what == "launcher":  # its children must not outlive it (checked by wait_gone below)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            assert records.status_of(out).startswith("died at step"), records.status_of(out)
        else:
            os.kill(_child(marker, needle), signal.SIGKILL)
            assert proc.wait(120) == 1, log_path.read_text()[-3000:]
            assert f"{what} exited unexpectedly" in log_path.read_text()
            assert records.status_of(out).startswith("died at step")
        assert chaos.wait_gone(marker, 30) == [], f"left behind after killing {what}"
        after = chaos.checkpoint_step(out)
        assert after < STEPS, "the run finished before the kill; lower the kill targets"
        launch_args = ["--resume", str(out), "--tracker", "none"]

    marker = uuid.uuid4().hex
    proc = _launch(["--resume", str(out), "--tracker", "tensorboard,wandb,mlflow"], marker, log_path)
    assert proc.wait(1100) == 0, log_path.read_text()[-4000:]
    assert chaos.wait_gone(marker, 30) == []
    output = log_path.read_text()

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    versions = [r["weight_version"] for r in rows]
    assert all(a < b for a, b in itertools.pairwise(versions)), versions
    trained = [json.loads(line) for line in (out / "trained_rollouts.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, STEPS + 1))
    ids = [rid for t in trained for rid in t["rollout_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * 2 * 4, "a rollout trained twice or lost"
    assert all(isinstance(r["dropped_future_version"], int) for r in rows)
    # rollout services caught up before generating, and each actor continued its prompt stream
    rollout_log = (out / "logs" / "rollout0.log").read_text()
    # Each launch's rollout service first served (and so first generated) at a version > 0 after a
    # resume: it was caught up to the trainer's re-published checkpoint weights before generating.
    # (A kill can land before a launch's rollout service is up: the trainer may train the stream's
    # backlog first. Such a launch has no SERVING line, and on a loaded box its rollout service may
    # not even have logged its settings before the launcher stopped it.)
    launches = rollout_log.split("parity settings:")[1:]
    assert 2 <= len(launches) <= 4, len(launches)
    first_serving = [
        int(part.split("health: SERVING (weight_version ")[1].split(")")[0])
        for part in launches
        if "health: SERVING (" in part
    ]
    assert first_serving[0] == 0 and len(first_serving) >= 2, first_serving
    assert all(v > 0 for v in first_serving[1:]), first_serving
    # and each actor continued its prompt stream after the last published draw
    draws = [
        int(line.rsplit("at draw ", 1)[1].split()[0])
        for line in rollout_log.splitlines()
        if "continuing the prompt stream at draw" in line
    ]
    assert len(draws) == len(first_serving) - 1 and draws == sorted(set(draws)), draws
    assert "resuming" in (out / "logs" / "trainer.log").read_text()
    assert output.count("redis-server restarted on its append-only file") == 3
    assert f"step {STEPS}/{STEPS}" in output  # the progress line under resume
    record = records.read(out)
    assert record["status"] == "finished" and record["step"] == STEPS
    resumed_from = [launch.get("resumed_from_step") for launch in record["launches"]]
    assert resumed_from[0] is None and all(isinstance(s, int) for s in resumed_from[1:]), resumed_from
    assert len(record["launches"]) == 4 and record["git"].get("commit")
    assert "## Run record" in (out / "summary.md").read_text()
    assert records.status_of(out) == "finished"
    from tests.test_trackers import assert_matches_metrics

    assert_matches_metrics(out, launch=4)


@pytest.mark.slow
def test_a_resume_that_trains_its_last_step_from_the_stream_ends_with_the_rollouts_caught_up(
    tmp_path: Path,
) -> None:
    """An async run leaves unread groups in its stream. Resumed for one more step, its trainer
    (started first, to serve catch-ups) trains that step from them before the rollout service has
    loaded; it must keep serving until the service holds the final version (trainer.await_workers),
    or the service never catches up and the launch fails waiting for it to serve."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    flags = chaos.run_flags(out, 2, "async", "reference", 5)
    assert chaos.launch(flags, uuid.uuid4().hex, log).wait(600) == 0, log.read_text()[-3000:]
    more = ["--resume", str(out), "--steps", "3", "--resume_override", "--tracker", "none",
            "--startup_timeout_s", "120"]  # fmt: skip
    marker = uuid.uuid4().hex
    assert chaos.launch(more, marker, log).wait(600) == 0, log.read_text()[-3000:]
    assert chaos.wait_gone(marker) == []
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "rollout worker(s) hold the final version" in trainer_log, trainer_log[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
