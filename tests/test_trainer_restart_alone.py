"""A trainer restarted alone (broadcast service and workers still running) publishes at once; a
broadcast service restarted alone at its address gets the workers back and the next version through.

The workers hold the data group of the current membership epoch between versions. A restarted
trainer changes neither the epoch's members nor its staleness, so without a new epoch its first
publish would name the old group: the newcomer would join it as rank 0 while the workers reuse the
group they already hold, and it would wait out the rendezvous timeout alone. Each Publisher sends
its own `publisher_id`; a new one starts a new epoch.

Real broadcast service, a real stand-in worker (process), real gloo, the real Publisher; the
restart is a second Publisher after the first one closed. The rendezvous timeout is short
(TIMEOUT_S), so the broken behaviour fails the first publish fast instead of waiting 300 s.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from broadcast.membership import Membership
from parity.ports import free_port
from parity.procs import ServiceProcess, start_service
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc
from parity.weights.sender import Publisher
from tests.fakes.fake_trainer import BUCKET_BYTES, MODEL, toy_weights, trainer_checksums

TOKEN = "restart-token"
TIMEOUT_S = 10.0  # rendezvous and collectives: what the old-group wait would cost here
FIRST_PUBLISH_BOUND_S = 60.0  # the restarted trainer waited 300 s


def test_a_new_publisher_starts_a_new_epoch_with_the_same_workers() -> None:
    members = Membership(max_workers=4, heartbeat_timeout_s=5.0, exclude_s=30.0)
    members.register(pb.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:1"))
    first, new = members.current_epoch("", "trainer-a")
    assert new
    assert members.current_epoch("", "trainer-a") == (first, False)  # same publisher: same group
    second, new = members.current_epoch("", "trainer-b")  # restarted: same workers, new group
    assert new and second.number == first.number + 1 and second.group_name != first.group_name
    assert second.members == first.members == ("w0",)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    broadcast = start_service(
        "broadcast",
        ["--heartbeat_interval_s", "0.5", "--heartbeat_timeout_s", "30", "--transfer_timeout_s", str(TIMEOUT_S),
         "--rpc_margin_s", "5", "--bucket_bytes", str(BUCKET_BYTES)],
        log_dir=tmp_path,
        env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
    ).wait_ready(240)  # fmt: skip
    worker = _start_worker(tmp_path, broadcast.address, "w0")
    try:
        yield broadcast.address
    finally:
        worker.stop(10)
        broadcast.stop(10)


def test_restarted_trainer_publishes_its_first_version_without_waiting_out_the_rendezvous(
    cluster: str, tmp_path: Path
) -> None:
    """Two restarts: after a trainer that vanished with its group still open (killed before its
    sockets closed: the newcomer would wait in connectFullMesh), and after one that closed it (the
    newcomer's first transfer would fail at once). Each newcomer's first attempt commits."""
    address = cluster
    with grpc.insecure_channel(address) as chan:
        stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
        _wait_registered(stub, "w0")
        vanished = _publisher(address)
        assert vanished.publish_tensors(toy_weights(1), 1).committed
        try:  # `vanished` is never used again; its group stays open until the end
            for version in (2, 3):
                epoch = _status(stub).epoch
                restarted = _publisher(address)
                assert restarted.publisher_id != vanished.publisher_id
                start = time.monotonic()
                try:
                    result = restarted.publish_tensors(toy_weights(version), version)  # no retry
                finally:
                    restarted.close()  # closed: the next restart meets a group whose rank 0 left
                elapsed = time.monotonic() - start
                assert result.committed and result.bytes_sent > 0
                assert elapsed < FIRST_PUBLISH_BOUND_S, f"v{version}: first publish took {elapsed:.1f}s"
                status = _status(stub)
                assert status.epoch > epoch and list(status.epoch_members) == ["w0"]
                info = {w.worker_id: w for w in status.workers}["w0"]
                assert (info.weight_version, info.verified) == (version, True), info
                served = json.loads((tmp_path / "w0.json").read_text())
                assert (served["version"], served["checksums"]) == (version, trainer_checksums(version))
        finally:
            vanished.close()


def _publisher(address: str) -> Publisher:
    return Publisher(address, MODEL, auth_token=TOKEN, bucket_bytes=BUCKET_BYTES)


def _start_worker(log_dir: Path, broadcast: str, worker_id: str) -> ServiceProcess:
    import subprocess

    port_file = log_dir / f"{worker_id}.port"
    log_path = log_dir / f"{worker_id}.log"
    cmd = [sys.executable, "-m", "tests.fakes.fake_receiver", "--broadcast_address", broadcast,
           "--worker_id", worker_id, "--auth_token", TOKEN, "--port_file", str(port_file),
           "--state_file", str(log_dir / f"{worker_id}.json")]  # fmt: skip
    with open(log_path, "ab") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return ServiceProcess(name=worker_id, proc=proc, port_file=port_file, log_path=log_path)


def _status(stub) -> pb.WeightBroadcastServiceGetStatusResponse:
    return stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)


def _wait_registered(stub, worker_id: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_id not in {w.worker_id for w in _status(stub).workers}:
        assert time.monotonic() < deadline, f"{worker_id} did not register"
        time.sleep(0.1)


RESTARTED_SYNC_BOUND_S = 30.0  # issue #37: weight sync works again within 30 s of the restart


def test_a_broadcast_service_restarted_alone_syncs_the_next_version_within_30_s(tmp_path: Path) -> None:
    """SIGKILL of the broadcast service while the trainer (a Publisher) and a worker keep running,
    then the same service again at the same address, as compose or Kubernetes restarts it: the
    worker registers again on its own, and the trainer's next version reaches it."""
    import signal

    args = ["--heartbeat_interval_s", "0.5", "--heartbeat_timeout_s", "30", "--transfer_timeout_s",
            str(TIMEOUT_S), "--rpc_margin_s", "5", "--bucket_bytes", str(BUCKET_BYTES)]  # fmt: skip
    env = {"PARITY_BROADCAST_AUTH_TOKEN": TOKEN}
    # a drawn port (parity.ports), not the kernel's: a port-0 bind is ephemeral, and another
    # process could take it in the 10 s the service is down
    port = str(free_port())
    broadcast = start_service("broadcast", [*args, "--port", port], log_dir=tmp_path, env=env).wait_ready(240)
    address = broadcast.address
    worker = _start_worker(tmp_path, address, "w0")
    publisher = None
    try:
        with grpc.insecure_channel(address) as chan:
            _wait_registered(broadcast_pb2_grpc.WeightBroadcastServiceStub(chan), "w0")
        publisher = _publisher(address)
        assert publisher.publish_tensors(toy_weights(1), 1).committed
        broadcast.signal(signal.SIGKILL)
        broadcast.proc.wait(10)
        # Down for 10 s, Kubernetes' first restart delay: the trainer's channel keeps failing to
        # connect meanwhile (its catch-up polls), and with gRPC's default reconnect backoff its next
        # publish, right after the restart, failed at once with UNAVAILABLE.
        time.sleep(10)
        broadcast = start_service(
            "broadcast", [*args, "--port", port], log_dir=tmp_path, env=env, name="broadcast-restarted"
        ).wait_ready(240)
        assert broadcast.address == address
        ready = time.monotonic()
        with grpc.insecure_channel(address) as chan:
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            _wait_registered(stub, "w0", timeout_s=RESTARTED_SYNC_BOUND_S)
            result = publisher.publish_tensors(toy_weights(2), 2)  # the trainer's next version, no retry
            elapsed = time.monotonic() - ready
            assert result.committed and result.bytes_sent > 0, result
            assert elapsed < RESTARTED_SYNC_BOUND_S, f"v2 reached the worker {elapsed:.1f}s after the restart"
            info = {w.worker_id: w for w in _status(stub).workers}["w0"]
            assert (info.weight_version, info.verified) == (2, True), info
        served = json.loads((tmp_path / "w0.json").read_text())
        assert (served["version"], served["checksums"]) == (2, trainer_checksums(2))
        print(f"v2 served {elapsed:.1f}s after the restarted broadcast service was ready")
    finally:
        if publisher is not None:
            publisher.close()
        worker.stop(10)
        broadcast.stop(10)
