"""`parity serve trainer` as a real subprocess: gRPC status codes, graceful stop, and kill -9 restarts
that lose no rollout and apply none twice."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from parity import health
from parity.rollout_queue import RolloutQueue
from parity.server import bearer
from parity.v1 import trainer_pb2, trainer_pb2_grpc
from tests.fakes.synthetic_rollouts import make_group
from tests.service_exit import exit_code
from trainer.policy import load_model

ROOT = Path(__file__).resolve().parents[1]
TEARDOWN_ABORTS = ROOT / "tests" / "fakes" / "teardown_abort"  # its sitecustomize aborts at exit
STREAM = "svc:rollouts"
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def groups(tiny_model: Path) -> list:
    model = load_model(tiny_model)
    gen = torch.Generator().manual_seed(0)
    rewards = [(1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 1.0)]
    return [
        make_group(model, f"g{i:02d}", rewards[i % 3], generator=gen, sample=False, completion_len=6)
        for i in range(12)
    ]


def trainer_args(redis_url: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", "tiny",
        "--redis_url", redis_url,
        "--stream", STREAM,
        "--run_dir", str(run_dir),
        "--groups_per_step", "1",
        "--micro_batch_size", "4",
        "--read_block_ms", "100",
        "--max_lag", "100",
        "--auth_token", TOKEN,
        *extra,
    ]  # fmt: skip


def status(stub) -> trainer_pb2.TrainerServiceGetStatusResponse:
    return stub.GetStatus(trainer_pb2.TrainerServiceGetStatusRequest(), timeout=5)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def test_bad_flags_exit_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    from services.trainer.server import main

    assert main(["--redis_url", "redis://127.0.0.1:1/0", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err
    assert main(["--redis_url", "redis://x/0", "--is_correction", "tis", "--is_cap", "0.5"]) == 2
    assert "is_cap" in capsys.readouterr().err


@pytest.mark.slow
def test_grpc_status_checkpoint_and_graceful_stop(
    redis_url: str, tmp_path: Path, start_services, groups: list
) -> None:
    run_dir = tmp_path / "run"
    # A teardown that aborts (a fake): the trainer must still exit 0 once stopped, as it does when
    # gloo or gRPC abort in a finalising interpreter (parity.process_exit)
    path = os.pathsep.join([str(TEARDOWN_ABORTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    svc = start_services(
        "trainer", *trainer_args(redis_url, run_dir, "--steps", "50"), env={"PYTHONPATH": path}
    )
    queue = RolloutQueue(redis_url, stream=STREAM)
    with grpc.insecure_channel(svc.address) as chan:
        stub = trainer_pb2_grpc.TrainerServiceStub(chan)
        first = status(stub)
        assert (first.step, first.weight_version, first.objective) == (0, 0, "grpo")
        with pytest.raises(grpc.RpcError) as denied:
            stub.RequestCheckpoint(trainer_pb2.RequestCheckpointRequest(), timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as denied:
            stub.Stop(trainer_pb2.StopRequest(), timeout=5, metadata=bearer("wrong"))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        queue.publish(groups[0])
        wait_for(lambda: (status(stub).step, status(stub).weight_version) == (1, 1), what="step 1 published")
        time.sleep(0.3)  # now idle, waiting for rollouts: the checkpoint is written right away
        reply = stub.RequestCheckpoint(
            trainer_pb2.RequestCheckpointRequest(), timeout=5, metadata=bearer(TOKEN)
        )
        assert reply.step == 1
        wait_for(
            lambda: (run_dir / "checkpoints" / "step_00000001" / "state.json").exists(), what="checkpoint"
        )
        queue.publish(groups[1])
        wait_for(lambda: (status(stub).step, status(stub).weight_version) == (2, 2), what="step 2 published")
        now = status(stub)
        assert (now.step, now.weight_version, now.rollouts_trained_total) == (2, 2, 8)
        assert now.last_metrics["step"] == 2.0 and "mismatch_k3" in now.last_metrics
        stopped = stub.Stop(trainer_pb2.StopRequest(), timeout=5, metadata=bearer(TOKEN))
        assert stopped.step == 2
        with pytest.raises(grpc.RpcError) as refused:
            stub.RequestCheckpoint(trainer_pb2.RequestCheckpointRequest(), timeout=5, metadata=bearer(TOKEN))
        assert refused.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
    assert svc.proc.wait(30) == 0
    assert (run_dir / "checkpoints" / "LATEST").read_text() == "step_00000002"
    assert queue.backlog() == 0


def lineage(run_dir: Path) -> list[str]:
    lines = (run_dir / "trained_rollouts.jsonl").read_text().splitlines()
    return [rid for line in lines for rid in json.loads(line)["rollout_ids"]]


@pytest.mark.slow
def test_kill_9_then_restart_loses_nothing_and_trains_nothing_twice(
    redis_url: str, tmp_path: Path, start_services, groups: list
) -> None:
    run_dir = tmp_path / "run"
    args = trainer_args(redis_url, run_dir, "--steps", "12", "--checkpoint_every", "3")
    queue = RolloutQueue(redis_url, stream=STREAM)
    for g in groups[:5]:
        queue.publish(g)
    # 1) Killed while waiting for data after step 5: steps 4-5 are acked but not checkpointed.
    svc = start_services("trainer", *args, name="life1")
    with grpc.insecure_channel(svc.address) as chan:
        stub = trainer_pb2_grpc.TrainerServiceStub(chan)
        wait_for(lambda: status(stub).step == 5, what="step 5")
        version_before_kill = status(stub).weight_version
    svc.signal(signal.SIGKILL)
    svc.proc.wait(10)
    assert queue.backlog() == 0  # everything delivered was acked: only the replay floor can save it
    # 2) Killed in the middle of a stream of work.
    svc = start_services("trainer", *args, name="life2")
    with grpc.insecure_channel(svc.address) as chan:
        stub = trainer_pb2_grpc.TrainerServiceStub(chan)
        restored = status(stub)
        assert restored.weight_version > version_before_kill  # re-published above the highest version
        for g in groups[5:]:
            queue.publish(g)
        wait_for(lambda: status(stub).step >= 8, what="step 8")
    svc.signal(signal.SIGKILL)
    svc.proc.wait(10)
    # 3) Runs to the end and exits 0.
    # Everything it needs is already queued, so it may finish before a health check sees it serving.
    svc = start_services("trainer", *args, name="life3", wait=False)
    assert exit_code(svc, 120) == 0, svc.log_tail()
    trained = lineage(run_dir)
    expected = sorted(s.rollout_id for g in groups for s in g.samples)
    assert sorted(trained) == expected  # every rollout exactly once in the final weights' lineage
    state = json.loads((run_dir / "checkpoints" / "step_00000012" / "state.json").read_text())
    assert sorted(state["applied_rollout_ids"]) == expected and state["step"] == 12
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    versions = [r["weight_version"] for r in rows]
    assert versions == sorted(versions) and state["weight_version"] > versions[-1]
    assert queue.backlog() == 0
    # 4) Started again on the finished run, as a Kubernetes StatefulSet restarts a pod that exited 0,
    # with after_last_step serve: it trains and writes nothing, and serves (finished) until SIGTERM.
    written = (run_dir / "checkpoints" / "step_00000012" / "state.json").stat().st_mtime_ns
    svc = start_services("trainer", *args, "--after_last_step", "serve", name="life4")
    with grpc.insecure_channel(svc.address) as chan:
        stub = trainer_pb2_grpc.TrainerServiceStub(chan)
        wait_for(lambda: status(stub).finished, what="finished")
        time.sleep(1.0)
        assert svc.alive() and health.check(svc.address) == (True, "SERVING"), svc.log_tail()
        now = status(stub)
        assert (now.step, now.finished, now.stopping) == (12, True, False)
    svc.signal(signal.SIGTERM)
    assert svc.proc.wait(30) == 0, svc.log_tail()
    assert (run_dir / "checkpoints" / "step_00000012" / "state.json").stat().st_mtime_ns == written
    assert "checkpoint step_" not in svc.log_path.read_text(), svc.log_tail()
    assert (run_dir / "checkpoints" / "LATEST").read_text() == "step_00000012"
