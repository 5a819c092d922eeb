"""`parity run` end to end: real redis-server, broadcast, trainer and vLLM rollout processes.

The slow tests share one short run of the tiny model (module fixture) and add one run that is
interrupted with SIGINT. Every child of a run carries PARITY_RUN_MARKER=<unique>; "no process left
behind" means no live process in /proc carries the marker once the launcher has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from commands.run.supervisor import MARKER_ENV, ChildDied, MetricsFollower, Supervisor, marked_pids
from parity.config import ConfigError, load

TINY_STEPS = 4
# Rollout-vs-trainer mismatch at fp32 (vLLM fp32 with processed logprobs and an fp32 head against the
# fp32 trainer; lag 0 and own version alike). Measured per step: tiny, 3 steps, k3 <= 1.8e-11 and
# max |delta| <= 3.4e-5; SmolLM2-135M, 4 runs x 16 steps (docs/run/*/metrics.jsonl, docs/benchmarks.md),
# k3 <= 8.4e-10 and max |delta| <= 1.3e-4. The bounds leave >= 100x on k3 and ~8x on max |delta| over
# the largest of these, while a bf16 head (k3 ~5e-4) or stale weights (k3 >= 1e-2) fail them.
MISMATCH_K3_BOUND = 1e-7
MISMATCH_MAX_ABS_BOUND = 1e-3
# The trainer's per-step metrics (CONTRACTS.md, trainer section).
METRIC_FIELDS = [
    "step", "weight_version", "reward_mean", "reward_std", "clip_rate", "kl_new_old", "entropy",
    "mismatch_k1", "mismatch_k2", "mismatch_k3", "mismatch_max_abs", "mismatch_ratio_p05",
    "mismatch_ratio_p50", "mismatch_ratio_p95", "policy_drift_k1", "policy_drift_k2", "policy_drift_k3",
    "policy_drift_max_abs", "policy_drift_ratio_p05", "policy_drift_ratio_p50", "policy_drift_ratio_p95", "ess", "lag_mean", "lag_max", "lag_hist", "dropped_stale", "tokens_per_s",
    "step_time_s", "lag0_token_frac", "mismatch_k1_own_version", "mismatch_k3_own_version",
    "mismatch_max_abs_own_version", "mismatch_k3_mixed_context", "own_version_tokens", "mismatch_tokens",
]  # fmt: skip
PLOTS = ["reward", "accuracy", "clip_rate", "kl_new_old", "entropy", "mismatch", "policy_drift", "ess", "lag"]
# A log line no clean run may hold: a logged error (vLLM's and ours), a traceback, a failing __del__.
ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|^Exception ignored in")


def _tiny_flags(out: Path, redis_url: str, steps: int, preflight: bool = False) -> list[str]:
    return [*([] if preflight else ["--skip_preflight"]),
        "--model", "tiny", "--steps", str(steps), "--groups_per_step", "2", "--group_size", "4",
        "--max_tokens", "8", "--eval_size", "8", "--redis_url", redis_url, "--out", str(out),
        "--max_model_len", "256", "--startup_timeout_s", "900",
    ]  # fmt: skip


def _launch(flags: list[str], marker: str, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, MARKER_ENV: marker, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "commands.main", "run", *flags],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _wait_gone(marker: str, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# --- fast: flags and supervision ------------------------------------------------------------------
def _run_config(flags: list[str]):
    return load(flags, home="run", environ={}).config


def test_flag_forms_are_equivalent() -> None:
    a = _run_config(["--steps", "3", "--rollout_workers", "2", "--prefix_caching", "true"])
    b = _run_config(["--steps=3", "--rollout-workers=2", "--prefix-caching"])
    c = _run_config(["--run.steps", "3", "--run.rollout_workers=2", "--rollout.prefix_caching=true"])
    assert a == b == c
    assert (a.run.steps, a.run.rollout_workers, a.rollout.prefix_caching) == (3, 2, True)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--steps=-1"], "run.steps"),
        (["--mode", "fast"], "run.mode"),
        (["--prefix_caching=maybe"], "rollout.prefix_caching"),
        (["--mode=sync", "--rollout_workers=3", "--groups_per_step=8"], "run.groups_per_step"),
        (["--lr", "abc"], "trainer.lr"),
        (["--eval_pass_k", "32"], "task.eval_pass_k"),  # above rollout.max_n: refused only after start-up
    ],
)
def test_bad_value_names_the_key(flags: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}:"):
        _run_config(flags)


def test_bad_flag_exits_2_with_a_clear_error() -> None:
    for flags, named in (
        (["--steps", "zero"], "run.steps"),
        (["--engine=tensorrt"], "rollout.engine"),
        (["--bogus", "1"], "--bogus"),
        (["--task", "chess"], "task.name"),
        (["--rollout_workers=2", "--rollout.port=50071"], "rollout.port: 50071 would be taken by each"),
        (["--trainer.port=50071", "--broadcast.port=50071"], "trainer.port: 50071 is also broadcast.port"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "commands.main", "run", *flags], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr
        assert "Traceback" not in proc.stderr


def test_child_death_is_reported_with_name_and_exit(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    with Supervisor(tmp_path, marker) as sup:
        sup.start_redis()
        assert marked_pids(marker) == [sup.children["redis"].proc.pid]
        sup.children["redis"].signal(signal.SIGKILL)
        sup.children["redis"].proc.wait(10)
        with pytest.raises(ChildDied, match=r"redis exited unexpectedly \(killed by SIGKILL") as info:
            sup.check()
        assert info.value.returncode == -signal.SIGKILL
    assert _wait_gone(marker) == []


def test_a_trainer_that_finished_before_it_was_seen_serving_is_ready_not_dead(tmp_path: Path) -> None:
    # A two-step trainer whose rollouts were already queued finished between two health polls on a
    # loaded box, and the launcher reported "trainer exited unexpectedly (exit code 0)".
    from parity.procs import ServiceProcess

    def child(name: str, code: int) -> ServiceProcess:
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        proc.wait(30)
        return ServiceProcess(
            name=name, proc=proc, port_file=tmp_path / f"{name}.port", log_path=tmp_path / "x.log"
        )

    with Supervisor(tmp_path, uuid.uuid4().hex) as sup:
        sup.children["trainer"] = child("trainer", 0)
        with pytest.raises(ChildDied, match=r"exit code 0"):
            sup.wait_ready(["trainer"], 5.0)
        sup.may_finish.add("trainer")
        sup.wait_ready(["trainer"], 5.0)
        sup.check()  # expected to be gone from now on
        sup.children["crashed"] = child("crashed", 1)
        sup.may_finish.add("crashed")
        with pytest.raises(ChildDied, match=r"crashed exited unexpectedly \(exit code 1"):
            sup.wait_ready(["crashed"], 5.0)


def test_a_trainer_that_finishes_while_the_rollouts_start_is_done_not_dead(tmp_path: Path) -> None:
    # A resumed trainer (started first) trained its last step from the stream and exited 0 while the
    # launcher waited for the rollout services: "trainer exited unexpectedly (exit code 0)".
    from parity.procs import ServiceProcess

    finished = subprocess.Popen([sys.executable, "-c", "raise SystemExit(0)"])
    finished.wait(30)
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Supervisor(tmp_path, uuid.uuid4().hex) as sup:
            for name, proc in (("trainer", finished), ("rollout0", starting)):
                sup.children[name] = ServiceProcess(
                    name=name, proc=proc, port_file=tmp_path / f"{name}.port", log_path=tmp_path / "x.log"
                )
            sup.may_finish.add("trainer")
            with pytest.raises(TimeoutError, match="rollout0 not SERVING"):  # not ChildDied(trainer)
                sup.wait_ready(["rollout0"], 1.0)
            assert "trainer" in sup.expect_exit
    finally:
        starting.kill()
        starting.wait(30)


def test_metrics_follower_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert follower.poll() == []
    path.write_text('{"step": 1}\n{"step": ')
    assert follower.poll() == [{"step": 1}]
    with open(path, "a") as handle:
        handle.write("2}\n")
    assert follower.poll() == [{"step": 2}]
    assert len(follower.rows) == 2


# --- slow: one real run of the tiny model ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    import redis

    redis.Redis.from_url(redis_server).flushall()
    out = tmp_path_factory.mktemp("run") / "run"
    marker = uuid.uuid4().hex
    log_path = out.parent / "launcher.log"
    started = time.monotonic()
    proc = _launch(_tiny_flags(out, redis_server, TINY_STEPS, preflight=True), marker, log_path)
    try:
        # A hang guard under pytest's 1,200 s: the run takes ~100-200 s in the suite, and outran 420 s
        # once on a day the box ran 2.5-3x slow (docs/benchmarks.md, "Test suite").
        rc = proc.wait(timeout=1100)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    output = log_path.read_text()
    stream_name = (
        json.loads((out / "config.json").read_text())["stream"] if (out / "config.json").exists() else ""
    )
    stream = redis.Redis.from_url(redis_server).xrange(stream_name) if stream_name else []
    return {
        "rc": rc,
        "out": out,
        "output": output,
        "marker": marker,
        "seconds": time.monotonic() - started,
        "rows": [
            json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
        if (out / "metrics.jsonl").exists()
        else [],
        "stream": stream,
    }


@pytest.mark.slow
def test_run_completes_and_versions_advance(tiny_run: dict) -> None:
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    rows = tiny_run["rows"]
    assert len(rows) == TINY_STEPS
    versions = [row["weight_version"] for row in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0], versions
    config = json.loads((tiny_run["out"] / "config.json").read_text())
    assert config["final_weight_version"] == TINY_STEPS  # publish_every 1: one version per step
    for status in config["final_rollout_status"].values():
        assert int(status["weight_version"]) == TINY_STEPS


@pytest.mark.slow
def test_later_steps_train_on_later_rollout_versions(tiny_run: dict) -> None:
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    # In publish order (one worker), each group's newest token version never goes backwards, the
    # first groups come from the initial weights and later ones from weights the trainer published.
    max_versions = [int(fields[b"max_version"]) for _, fields in tiny_run["stream"]]
    assert max_versions, "no rollout groups in the stream"
    assert max_versions == sorted(max_versions), max_versions
    assert max_versions[0] == 0
    assert max_versions[-1] >= TINY_STEPS - 2, max_versions
    rows = tiny_run["rows"]
    # The mean version of the rollouts each step trained on (trainer version minus mean lag) rises.
    consumed = [row["weight_version"] - row["lag_mean"] for row in rows]
    assert consumed[-1] > consumed[0], consumed


@pytest.mark.slow
def test_lag0_mismatch_is_small(tiny_run: dict) -> None:
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    # fp32 on both sides: the numerical paths differ only in kernel order (MISMATCH_K3_BOUND).
    for row in tiny_run["rows"]:
        if row["mismatch_tokens"] == 0:  # every lag-0 token was mixed-context (or none): not measured
            assert row["mismatch_k3"] is None and row["mismatch_max_abs"] is None, row
    for row in rows_with_clean_lag0(tiny_run["rows"]):
        assert 0 <= row["mismatch_k3"] < MISMATCH_K3_BOUND, row
        assert row["mismatch_max_abs"] < MISMATCH_MAX_ABS_BOUND, row


@pytest.mark.slow
def test_own_version_mismatch_is_measured_on_every_step(tiny_run: dict) -> None:
    """The promise on every step (issue 17): whatever the lag, each step scores clean tokens at the
    version that sampled them, and the number is small (null would mean: not measured)."""
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    for row in tiny_run["rows"]:
        k3 = row["mismatch_k3_own_version"]
        assert k3 is not None and 0 <= k3 < MISMATCH_K3_BOUND, row
        assert (
            row["own_version_tokens"] > 0 and row["mismatch_max_abs_own_version"] < MISMATCH_MAX_ABS_BOUND
        ), row


def rows_with_clean_lag0(rows: list[dict]) -> list[dict]:
    """Steps whose backend mismatch was measured: some lag-0 token sampled over KV of its own version
    (a step whose lag-0 tokens all attended to older KV has lag0_token_frac > 0 and mismatch null)."""
    picked = [row for row in rows if row["mismatch_tokens"] > 0]
    assert picked, f"no step trained on clean lag-0 tokens: {[row['mismatch_tokens'] for row in rows]}"
    return picked


@pytest.mark.slow
def test_metrics_jsonl_has_every_field(tiny_run: dict) -> None:
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    for row in tiny_run["rows"]:
        missing = [name for name in METRIC_FIELDS if name not in row]
        assert not missing, f"metrics.jsonl row lacks {missing}"


@pytest.mark.slow
def test_run_directory_holds_config_eval_plots_summary(tiny_run: dict) -> None:
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    out = tiny_run["out"]
    config = json.loads((out / "config.json").read_text())
    settings = config["rollout_services"]["rollout0"]["settings"]
    assert settings["logprobs_mode"] == "LOGPROBS_MODE_PROCESSED"
    assert settings["head_dtype"] == "float32" and settings["prefix_caching"] is False
    assert config["config"]["model"]["name"] == "tiny" and config["config"]["run"]["steps"] == TINY_STEPS
    assert config["preflight"]["ran"] and config["preflight"]["passed"], config["preflight"]
    assert "auth_token" not in (out / "config.toml").read_text()  # the token never lands on disk
    evals = json.loads((out / "eval.json").read_text())
    assert evals["before"]["weight_versions"] == [0]
    assert evals["after"]["weight_versions"] == [TINY_STEPS]
    assert evals["before"]["num_prompts"] == 8 and len(evals["after"]["items"]) == 8
    for name in PLOTS:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (out / "summary.md").read_text()
    assert "held-out accuracy" in summary and "(reward.png)" in summary
    assert f"step {TINY_STEPS}/{TINY_STEPS}" in tiny_run["output"]  # progress lines were printed


@pytest.mark.slow
def test_a_clean_run_leaves_no_error_in_any_service_log(tiny_run: dict) -> None:
    # The stop signals each service's whole process group: vLLM's worker used to exit before its
    # engine core, which then logged "EngineCore encountered a fatal error" and a dump of its
    # scheduler at the end of every run; and the engine's __del__ raised in interpreter teardown.
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    logs = sorted((tiny_run["out"] / "logs").glob("*.log"))
    assert {path.stem for path in logs} >= {"rollout0", "trainer", "broadcast"}, logs
    for path in logs:
        bad = [line for line in path.read_text(errors="replace").splitlines() if ERROR_LINE.search(line)]
        assert bad == [], f"{path.name}:\n" + "\n".join(line[:300] for line in bad[:20])


@pytest.mark.slow
def test_all_processes_exit_after_the_run(tiny_run: dict) -> None:
    assert tiny_run["rc"] == 0, tiny_run["output"][-4000:]
    assert _wait_gone(tiny_run["marker"]) == []


@pytest.mark.slow
def test_sigint_mid_run_leaves_no_process_behind(redis_url: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    marker = uuid.uuid4().hex
    log_path = tmp_path / "launcher.log"
    proc = _launch(_tiny_flags(out, redis_url, steps=500), marker, log_path)
    try:
        deadline = time.monotonic() + 900
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "no training step within 900 s"
            time.sleep(0.5)
        live = marked_pids(marker)
        assert len(live) >= 5, live  # launcher, broadcast, trainer, rollout, engine core (redis is external)
        titles = []
        for pid in live:
            with contextlib.suppress(OSError):  # exited since the listing
                titles.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        # vLLM's processes are found too (by their title), so the check below covers them
        assert sum(b"::EngineCore" in t for t in titles) == 1, titles  # the model runs in it (no worker)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, log_path.read_text()[-4000:]
    assert "interrupted" in log_path.read_text()
    assert _wait_gone(marker) == []


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("19", 1.0),
        ("7 + 12 = 19", 1.0),
        ("7 + 12 = 19.", 1.0),
        ("19, no: 20", 0.0),
        ("7 + 12", 0.0),
        ("", 0.0),
    ],
)
def test_default_task_scores_the_final_integer(completion: str, reward: float) -> None:
    from rollout.tasks import Prompt, get_task

    task = get_task(_run_config([]).task.name)
    assert task.name == "arithmetic_final"
    assert (
        task.reward(Prompt("p", "What is 7 + 12? Answer with just the number.", "19"), completion) == reward
    )
    assert task.eval_prompts(5) == get_task("arithmetic").eval_prompts(5)  # same held-out split


def test_an_unusable_out_or_resume_dir_is_a_clear_error_before_anything_starts(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    broken = tmp_path / "broken_run"
    broken.mkdir()
    (broken / "config.toml").write_text("foo = 1\n")
    for flags, named in (
        (["--model", "tiny", "--out", str(a_file / "run")], "run.out:"),
        (["--resume", str(broken)], "foo: expected a [foo] table"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "commands.main", "run", *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_two_launches_in_one_second_never_share_a_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from commands.run.launcher import claim_run_dir
    from parity.config import load

    monkeypatch.chdir(tmp_path)
    cfg = load([], home="run", environ={}).config
    claimed = [claim_run_dir(cfg) for _ in range(3)]  # within one second: one name, three directories
    assert len(set(claimed)) == 3 and all(d.is_dir() for d in claimed)
    assert claimed[1].name == f"{claimed[0].name}-2" or claimed[1].name[:15] != claimed[0].name[:15]


def test_progress_never_waits_for_a_step_past_the_last() -> None:
    from commands.run.launcher import waiting_for

    assert [waiting_for(done, 2) for done in (0, 1, 2, 3)] == [
        "first step",
        "step 2",
        "the trainer to finish (its last checkpoint and publish)",
        "the trainer to finish (its last checkpoint and publish)",
    ]


def test_a_built_in_model_prepared_on_first_use_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from commands.run.launcher import validate_inputs
    from parity.config import load

    monkeypatch.setenv("PARITY_HOME", str(tmp_path / "home"))  # nothing prepared here
    cfg = load(["--model", "tiny"], home="run", environ={}).config
    validate_inputs(cfg)
    assert "preparing tiny (first use" in capsys.readouterr().out
    validate_inputs(cfg)  # prepared now: nothing to say
    assert "preparing" not in capsys.readouterr().out
