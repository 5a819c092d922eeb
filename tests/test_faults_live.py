"""A fault injected into a live `parity run` (real services, the reference engine, real Redis): the
running gate stops the run at the first step that trains on a faulty token, the launcher exits
non-zero with the gate's message, and the run directory holds the localisation naming the class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commands.run.supervisor import MARKER_ENV
from trainer.mismatch_locate import MISMATCH_REPORT

STEPS, FAULT_VERSION = 6, 2  # sync mode: version v is trained at step v + 1


def _run(out: Path, fault: str, log_path: Path) -> subprocess.CompletedProcess:
    flags = ["--skip_preflight", "--model", "tiny", "--mode", "sync", "--steps", str(STEPS),
        "--groups_per_step", "2", "--group_size", "4", "--max_tokens", "8", "--eval_size", "0",
        "--max_model_len", "256", "--startup_timeout_s", "900", "--out", str(out),
        "--rollout.engine", "reference", "--rollout.enable_fault_injection", "true", "--rollout.fault", fault,
    ]  # fmt: skip
    env = {**os.environ, MARKER_ENV: f"faults-live-{os.getpid()}", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        return subprocess.run(
            [sys.executable, "-m", "commands.main", "run", *flags],
            stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=1100,
        )  # fmt: skip


@pytest.mark.slow
def test_live_run_with_raw_logprobs_from_version_2_stops_at_step_3_and_names_the_fault(
    tmp_path: Path,
) -> None:
    out, log_path = tmp_path / "run", tmp_path / "launcher.log"
    proc = _run(out, f"raw_logprobs@{FAULT_VERSION}", log_path)
    log = log_path.read_text(errors="replace")
    assert proc.returncode != 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gated = [r["mismatch_k3_own_version_informative"] for r in rows]
    # Steps 1-2 trained versions 0-1 (clean, float32: far under 1e-6); step 3 the first faulty one.
    assert len(rows) == FAULT_VERSION + 1, gated
    assert all(v is not None and v < 1e-9 for v in gated[:FAULT_VERSION]), gated
    assert gated[FAULT_VERSION] > 1e-3, gated
    assert "running gate's threshold 1e-06" in log and "Localisation:" in log, log[-3000:]
    report = json.loads((out / f"{MISMATCH_REPORT}.json").read_text())
    assert report["candidates"][0]["fault"] == "raw_logprobs", report["candidates"][:3]
    assert (out / f"{MISMATCH_REPORT}.png").exists()


def test_a_fault_is_refused_without_fault_injection_and_outside_the_reference_engine(tmp_path: Path) -> None:
    from parity.config import ParityConfig

    def error(**rollout) -> str:
        with pytest.raises(ValueError) as info:
            ParityConfig.model_validate({"model": {"name": "tiny"}, "rollout": rollout})
        return str(info.value)

    assert "rollout.enable_fault_injection" in error(engine="reference", fault="raw_logprobs@2")
    assert "rollout.engine reference" in error(enable_fault_injection=True, fault="raw_logprobs@2")
    assert "unknown fault 'nope'" in error(engine="reference", enable_fault_injection=True, fault="nope@1")
    assert "rollout.engine reference" in error(
        engine="vllm", enable_fault_injection=True, fault="rope_theta@1"
    )
    assert "run.rollout_workers >= 2" in error(
        engine="reference", enable_fault_injection=True, fault="one_worker_not_updated@2"
    )
    for fault in ("stale_weights@3", "rope_theta@1", "episode_retokenized@2"):  # every class is live
        ok = {"engine": "reference", "enable_fault_injection": True, "fault": fault}
        assert ParityConfig.model_validate({"model": {"name": "tiny"}, "rollout": ok}).rollout.fault == fault
    two_workers = {"model": {"name": "tiny"}, "run": {"rollout_workers": 2},
                   "rollout": {"engine": "reference", "enable_fault_injection": True,
                               "fault": "one_worker_not_updated@2"}}  # fmt: skip
    assert ParityConfig.model_validate(two_workers).rollout.fault == "one_worker_not_updated@2"


def test_the_live_bench_finds_the_first_step_that_trains_a_changed_rollout(tmp_path: Path) -> None:
    """bench/faults_live.py's first faulty step for episode_version_tag (async: no fixed step): the
    rollouts the actor logged as changed, joined with the trainer's trained_rollouts.jsonl."""
    from bench.faults_live import changed_rollouts, first_trained_step
    from rollout.episodes import FAULTY_ROLLOUTS_LOG

    name = "episode_version_tag"
    log = "\n".join([
        "12:00:01 WARNING rollout.actor " + FAULTY_ROLLOUTS_LOG % (name, "w0-r-7/1 w0-r-7/3"),
        "12:00:02 WARNING rollout.actor " + FAULTY_ROLLOUTS_LOG % ("episode_retokenized", "w0-r-2/0"),
        "12:00:03 INFO rollout.actor published w0-r-9",
    ])  # fmt: skip
    changed = changed_rollouts(name, [log])
    assert changed == {"w0-r-7/1", "w0-r-7/3"}
    trained = [
        (1, ["w0-r-1/0", "w0-r-2/0"]),
        (2, ["w0-r-5/0", "w0-r-7/0"]),
        (3, ["w0-r-7/3"]),
        (4, ["w0-r-7/1"]),
    ]
    (tmp_path / "trained_rollouts.jsonl").write_text(
        "".join(json.dumps({"step": s, "rollout_ids": ids}) + "\n" for s, ids in trained)
    )
    assert first_trained_step(tmp_path, changed) == 3  # w0-r-7/0 at step 2 was not changed
    assert first_trained_step(tmp_path, {"w0-r-8/0"}) is None  # changed but never trained
    assert first_trained_step(tmp_path, set()) is None
