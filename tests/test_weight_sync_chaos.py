"""Weight sync v2 under faults, on CPU: real broadcast service, real stand-in workers (processes),
real gloo, the real `parity.weights.sender.Publisher`.

Each case starts its own broadcast service with short deadlines (transfer_timeout_s=4). In every case
the surviving workers end on a verified version (their served checksums equal the trainer's and the
service marks them verified), nothing waits longer than its deadline, and a new membership epoch
forms without the dead member.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from parity.procs import ServiceProcess, start_service
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc
from parity.weights.sender import Publisher, PublishError
from tests.fakes.fake_trainer import BUCKET_BYTES, MODEL, toy_weights, trainer_checksums

pytestmark = pytest.mark.slow

TOKEN = "chaos-token"
TIMEOUT_S = 8.0  # each collective wait: a loaded box must not miss it with a healthy receiver
# a version settles within: the collective deadline, the never-joining worker's own answer, slack
SETTLE_S = 2 * TIMEOUT_S + 6


class Cluster:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.broadcast = start_service(
            "broadcast",
            ["--heartbeat_interval_s", "0.5", "--heartbeat_timeout_s", "30", "--transfer_timeout_s",
             str(TIMEOUT_S), "--retry_failed_after_s", "30", "--bucket_bytes", str(BUCKET_BYTES)],
            log_dir=log_dir,
            env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
        ).wait_ready(240)  # fmt: skip
        self.channel = grpc.insecure_channel(self.broadcast.address)
        self.stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self.channel)
        self.workers: dict[str, ServiceProcess] = {}

    def add(self, worker_id: str, *extra: str, wait: bool = True) -> ServiceProcess:
        port_file = self.log_dir / f"{worker_id}.port"
        port_file.unlink(missing_ok=True)
        log_path = self.log_dir / f"{worker_id}.log"
        cmd = [sys.executable, "-m", "tests.fakes.fake_receiver", "--broadcast_address", self.broadcast.address,
               "--worker_id", worker_id, "--auth_token", TOKEN, "--port_file", str(port_file),
               "--state_file", str(self.log_dir / f"{worker_id}.json"), *extra]  # fmt: skip
        with open(log_path, "ab") as handle:
            proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        worker = ServiceProcess(name=worker_id, proc=proc, port_file=port_file, log_path=log_path)
        self.workers[worker_id] = worker
        if wait:
            worker.wait_ready(240)
        return worker

    def wait_registered(self, ids: set[str], timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not ids <= set(self.status_workers()):
            assert time.monotonic() < deadline, f"{ids} did not register"
            time.sleep(0.1)

    def publisher(self) -> Publisher:
        return Publisher(self.broadcast.address, MODEL, auth_token=TOKEN, bucket_bytes=BUCKET_BYTES)

    def status(self) -> pb.WeightBroadcastServiceGetStatusResponse:
        return self.stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)

    def status_workers(self) -> dict[str, pb.WorkerInfo]:
        return {w.worker_id: w for w in self.status().workers}

    def state(self, worker_id: str) -> dict:
        served = json.loads((self.log_dir / f"{worker_id}.json").read_text())
        return {"version": served["version"], "checksums": served["checksums"]}

    def assert_verified(
        self, worker_ids: tuple[str, ...], version: int, state: int = pb.WORKER_STATE_SERVING
    ) -> None:
        """Each worker serves `version` with the trainer's checksums, and the service recorded it
        from a verified ack (`state` FAILED: its last update failed and it kept this version)."""
        status = self.status_workers()
        for worker_id in worker_ids:
            assert self.state(worker_id) == {"version": version, "checksums": trainer_checksums(version)}
            info = status[worker_id]
            assert (info.weight_version, info.verified, info.state) == (version, True, state), info

    def wait_until(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        for worker in self.workers.values():
            worker.stop(10)
        self.broadcast.stop(10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    env = Cluster(tmp_path)
    yield env
    env.close()


def test_receiver_killed_mid_transfer(cluster: Cluster) -> None:
    cluster.add("r0", wait=False)
    cluster.add("r1", wait=False)
    cluster.add("victim", "--bucket_delay_s", "0.5", wait=False)  # ~2.5 s per version: killable inside
    cluster.wait_registered({"r0", "r1", "victim"})
    publisher = cluster.publisher()
    publisher.publish_tensors(toy_weights(1), 1)
    cluster.assert_verified(("r0", "r1", "victim"), 1)
    epoch = cluster.status().epoch

    outcome: list = []
    sender = threading.Thread(target=lambda: outcome.append(_try_publish(publisher, 2)))
    sender.start()
    cluster.wait_until(
        lambda: cluster.status_workers()["victim"].state == pb.WORKER_STATE_UPDATING, 10, "no update started"
    )
    time.sleep(0.7)  # inside the transfer
    cluster.workers["victim"].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    sender.join(SETTLE_S + 10)
    assert not sender.is_alive(), "the trainer's publish hung"
    assert time.monotonic() - killed_at < SETTLE_S
    assert cluster.state("victim")["version"] == 1  # never half-updated
    # survivors: on v2 if they verified it, else still on v1; either way verified, and v3 lands
    version = 3 if outcome[0] == "" else 2
    publisher.publish_tensors(toy_weights(version), version)
    cluster.assert_verified(("r0", "r1"), version)
    status = cluster.status()
    assert status.epoch > epoch and sorted(status.epoch_members) == ["r0", "r1"]
    publisher.close()


def test_receiver_that_never_joins(cluster: Cluster) -> None:
    cluster.add("r0", wait=False)
    cluster.add("r1", wait=False)
    cluster.add("ghost", "--never_join", wait=False)
    cluster.wait_registered({"r0", "r1", "ghost"})
    publisher = cluster.publisher()
    start = time.monotonic()
    with pytest.raises(PublishError, match=r"version 1"):
        publisher.publish_tensors(toy_weights(1), 1)  # the group cannot form without the ghost
    assert time.monotonic() - start < SETTLE_S
    for worker_id in ("r0", "r1"):
        assert cluster.state(worker_id)["version"] == 0  # kept the old weights
    ghost = cluster.status_workers()["ghost"]
    assert "never joined" in ghost.last_error
    # the same number again: a new epoch without the ghost, verified by both
    publisher.publish_tensors(toy_weights(1), 1)
    cluster.assert_verified(("r0", "r1"), 1)
    assert sorted(cluster.status().epoch_members) == ["r0", "r1"]
    publisher.close()


def test_trainer_killed_mid_transfer(cluster: Cluster) -> None:
    cluster.add("r0", "--bucket_delay_s", "0.4", wait=False)
    cluster.add("r1", "--bucket_delay_s", "0.4", wait=False)
    cluster.wait_registered({"r0", "r1"})
    publisher = cluster.publisher()
    publisher.publish_tensors(toy_weights(1), 1)
    epoch = cluster.status().epoch
    publisher.close()
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fake_trainer", "--broadcast_address", cluster.broadcast.address,
         "--versions", "2"],
        env={**_environ(), "PARITY_AUTH_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        cluster.wait_until(
            lambda: cluster.status_workers()["r0"].last_attempted_version == 2, 60, "v2 never started"
        )
        time.sleep(0.6)  # inside the transfer
        trainer.kill()
        killed_at = time.monotonic()
    finally:
        trainer.wait(10)
    reply = cluster.stub.WaitVersion(
        pb.WaitVersionRequest(version=2, state=pb.VERSION_STATE_DISTRIBUTED, timeout_s=SETTLE_S),
        timeout=SETTLE_S + 5,
    )
    assert not reply.reached and reply.version.state == pb.VERSION_STATE_FAILED, reply
    assert time.monotonic() - killed_at < SETTLE_S
    cluster.assert_verified(("r0", "r1"), 1, pb.WORKER_STATE_FAILED)  # both kept their verified weights
    # a restarted trainer publishes the same number: new epoch, verified by both
    publisher = cluster.publisher()
    publisher.publish_tensors(toy_weights(2), 2)
    cluster.assert_verified(("r0", "r1"), 2)
    assert cluster.status().epoch > epoch
    publisher.close()


def test_worker_joining_during_training_catches_up_then_joins_the_next_epoch(cluster: Cluster) -> None:
    cluster.add("r0")
    publisher = cluster.publisher()
    publisher.publish_tensors(toy_weights(1), 1)
    publisher.publish_tensors(toy_weights(2), 2)
    epoch = cluster.status().epoch
    late = cluster.add("late", wait=False)  # starts at the checkpoint (v0), behind the trainer
    late.wait_ready(240)  # ready only once it serves the latest version: the trainer's catch-up
    # counted by the sender's thread after its group closes: later than the worker shows the version
    cluster.wait_until(lambda: publisher.catch_ups_sent >= 1, 60, "the catch-up was never counted")
    assert publisher.catch_ups_sent == 1
    cluster.assert_verified(("r0", "late"), 2)
    publisher.publish_tensors(toy_weights(3), 3)  # the join started a new epoch with both
    cluster.assert_verified(("r0", "late"), 3)
    status = cluster.status()
    assert status.epoch > epoch and sorted(status.epoch_members) == ["late", "r0"]
    publisher.close()


def _try_publish(publisher: Publisher, version: int) -> str:
    try:
        publisher.publish_tensors(toy_weights(version), version)
        return ""
    except PublishError as exc:
        return str(exc)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
