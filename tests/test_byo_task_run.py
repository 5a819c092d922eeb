"""Bring your own task, end to end (issue 18): two real `parity run`s of the tiny model.

A. `--task reasoning_gym:basic_arithmetic --steps 2`, with the chat template off, a held-out eval
   every step and pass@2: rewards in [0, 1]; trained prompts disjoint from the held-out ones; the
   mid-training eval, pass@k and its plot are recorded.
B. `--task jsonl:examples/gsm8k_mini.jsonl --steps 2` with a system prompt and the reward
   `0.5*math_verify,0.5*grpc:<the Node RewardService>,0*tests.reward_helpers:faulty`. The faulty
   component raises for some prompts and hangs for others (fixed by the prompt text), so in one run:
   the Node service is the reward the trainer learns from; a raising and a hanging reward are both
   counted and dropped (every published group's prompt is one the faulty reward scores, so no
   failed group was scored 0) and the run finishes. Without node this test fails.

Both runs skip the preflight and dynamic sampling (the random tiny model gets the same reward on
every sample) to stay within the suite's budget.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from parity.v1 import rollouts_pb2
from tests.reward_helpers import ROOT, fault_kind, start_node_reward_server
from tests.test_launcher import _launch, _tiny_flags, _wait_gone

STEPS = 2


# The task and the rewards are what is tested: the reference engine (exact HF numerics) starts in a
# fifth of vLLM's CPU time (bench/engine_start.py); the launcher's tests run vLLM.
ENGINE = ["--rollout.engine", "reference"]


def _run(flags: list[str], out: Path, redis_url: str) -> dict:
    import redis

    marker = uuid.uuid4().hex
    log_path = out.parent / f"{out.name}.log"
    proc = _launch(
        [*_tiny_flags(out, redis_url, STEPS), "--skip_zero_variance", "false", *ENGINE, *flags],
        marker,
        log_path,
    )
    rc: int | None = None  # None: still running at the deadline (the log tail says where)
    try:
        rc = proc.wait(timeout=1100)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()  # its services follow it (PR_SET_PDEATHSIG)
                proc.wait(10)
    output = log_path.read_text()
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    entries = redis.Redis.from_url(redis_url).xrange(config["stream"]) if config else []
    groups = [rollouts_pb2.RolloutGroup.FromString(fields[b"group"]) for _, fields in entries]
    rollout_log = (
        "".join(p.read_text() for p in sorted((out / "logs").glob("rollout0*"))) if out.exists() else ""
    )
    return {
        "rc": rc,
        "out": out,
        "output": output,
        "groups": groups,
        "rollout_log": rollout_log,
        "marker": marker,
        "rows": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        if (out / "metrics.jsonl").exists()
        else [],
        "eval": json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else {},
    }


def _assert_finished(run: dict) -> None:
    assert run["rc"] == 0, run["output"][-4000:] + run["rollout_log"][-4000:]
    assert len(run["rows"]) == STEPS
    assert _wait_gone(run["marker"]) == []


def _assert_rewards_in_unit_range_and_held_out_disjoint(run: dict) -> None:
    rewards = [s.reward for g in run["groups"] for s in g.samples]
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards), rewards
    trained = {(g.prompt_id, g.prompt_text) for g in run["groups"]}
    held_out = {(i["prompt_id"], i["prompt"]) for e in run["eval"]["evals"] for i in e["items"]}
    assert trained and held_out
    assert not {i for i, _ in trained} & {i for i, _ in held_out}
    assert not {t for _, t in trained} & {t for _, t in held_out}
    for e in run["eval"]["evals"]:
        for item in e["items"]:
            assert item["reward"] is None or 0.0 <= item["reward"] <= 1.0, item


@pytest.fixture(scope="module")
def gym_run(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    flags = [
        "--task",
        "reasoning_gym:basic_arithmetic",
        "--chat_template",
        "off",
        "--eval_every",
        "1",
        "--eval_pass_k",
        "2",
    ]
    return _run(flags, tmp_path_factory.mktemp("gym") / "run", redis_server)


@pytest.mark.slow
def test_reasoning_gym_run_completes_with_rewards_in_unit_range_and_disjoint_eval(gym_run: dict) -> None:
    _assert_finished(gym_run)
    _assert_rewards_in_unit_range_and_held_out_disjoint(gym_run)
    assert all(g.task == "reasoning_gym:basic_arithmetic" for g in gym_run["groups"])
    assert all(g.prompt_id.startswith("rg-basic_arithmetic-train-") for g in gym_run["groups"])


@pytest.mark.slow
def test_eval_every_and_pass_at_k_are_logged_and_plotted(gym_run: dict) -> None:
    _assert_finished(gym_run)
    evals = gym_run["eval"]["evals"]
    assert [(e["label"], e["step"]) for e in evals] == [("before", 0), ("step 1", 1), ("after", STEPS)]
    for e in evals:
        assert e["pass_k"] == 2 and e["pass_at_k"] is not None and 0.0 <= e["pass_at_k"] <= 1.0
        assert e["reward_mean"] is not None and e["rewards_failed"] == 0
        assert all(len(i["sample_rewards"]) == 2 for i in e["items"])
    assert (gym_run["out"] / "eval_reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pass@2" in (gym_run["out"] / "summary.md").read_text()
    assert "held-out accuracy step 1:" in gym_run["output"]
    config = json.loads((gym_run["out"] / "config.json").read_text())["config"]["task"]
    assert config["chat_template"] is False


@pytest.fixture(scope="module")
def gsm8k_run(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("gsm8k")
    node, address = start_node_reward_server(base / "node.port")
    try:
        reward = f"0.5*math_verify,0.5*grpc:{address},0*tests.reward_helpers:faulty"
        flags = ["--task", "jsonl:examples/gsm8k_mini.jsonl", "--reward", reward, "--reward_timeout_s", "2",
                 "--system_prompt", "Solve the problem. End with the number."]  # fmt: skip
        return _run(flags, base / "run", redis_server)
    finally:
        node.terminate()
        node.wait(10)


@pytest.mark.slow
def test_jsonl_math_verify_run_with_the_node_reward_service_completes(gsm8k_run: dict) -> None:
    _assert_finished(gsm8k_run)
    _assert_rewards_in_unit_range_and_held_out_disjoint(gsm8k_run)
    assert {g.prompt_id for g in gsm8k_run["groups"]} <= {f"gsm8k-mini-{i:03d}" for i in range(40)}
    assert (
        "grpc:127.0.0.1:" in gsm8k_run["output"]
        or "grpc:127.0.0.1:" in (gsm8k_run["out"] / "config.toml").read_text()
    )


@pytest.mark.slow
def test_raising_and_hanging_rewards_are_counted_and_dropped_and_the_run_finishes(gsm8k_run: dict) -> None:
    _assert_finished(gsm8k_run)
    published = {g.prompt_text for g in gsm8k_run["groups"]}
    assert published and {fault_kind(t) for t in published} == {"score"}  # no failed group got a score
    log = gsm8k_run["rollout_log"]
    failures = re.findall(r"reward failed for group \S+ \(prompt (\S+)\); group dropped: (\w+):", log)
    kinds = {kind for _, kind in failures}
    assert kinds == {"error", "timeout"}, failures
    assert "faulty reward: this prompt raises" in log and "no result within 2s" in log
    counted = [int(n) for n in re.findall(r"rewards_failed_total=(\d+)", log)]
    assert counted and max(counted) == len(failures)
    # Held-out answers to failing prompts are left out of the means and counted, not scored 0 (the
    # four held-out prompts of gsm8k_mini all raise under `faulty`, so every evaluation counts some).
    evals = gsm8k_run["eval"]["evals"]
    assert evals and all(e["rewards_failed"] > 0 for e in evals), evals
    for e in evals:
        failed_items = [i for i in e["items"] if i["reward"] is None]
        assert e["rewards_failed"] == len(failed_items)
        assert all(fault_kind(i["prompt"]) != "score" for i in failed_items)


def test_a_malformed_jsonl_line_is_rejected_before_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(
        '{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?", "answer": 4,}\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "commands.main", "run", "--task", f"jsonl:{bad}", "--model", "tiny", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"task.name: {bad}:2: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started, no run directory
