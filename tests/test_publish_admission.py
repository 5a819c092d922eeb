"""PublishVersion admission over real gRPC (loopback, a real broadcast service process).

- A version larger than every registered worker says it can receive into is refused up front
  (RESOURCE_EXHAUSTED naming `tensors`), changes nothing, and the real model publishes next.
- A worker that reported no capacity (an older client) refuses nothing.
- A version that went to no worker (an epoch without workers) does not register the model: the
  next publish of another model is accepted.
- Bad `receive_capacity_bytes` and `publisher_id` are INVALID_ARGUMENT naming the field.

Three tests, each with its own service (about 10 s to start).

The workers here are registrations only (their addresses answer nothing): every refusal happens
before any UpdateWeights, and an accepted version to them fails, which is all these checks need.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from parity.procs import ServiceProcess, start_service
from parity.server import bearer
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2

TOKEN = "admission-token"
AUTH = bearer(TOKEN)
GIB = 1 << 30


def _request(version: int, model: str, shape: tuple[int, ...], **extra) -> pb.PublishVersionRequest:
    meta = common_pb2.TensorMeta(name="w", shape=list(shape), dtype="float32", checksum=1)
    return pb.PublishVersionRequest(
        version=version,
        model=model,
        tensors=[meta],
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
        **extra,
    )


BOGUS = (8, GIB)  # 32 GiB of float32
TINY = (4, 4)


@pytest.fixture
def broadcast(tmp_path: Path) -> Iterator[ServiceProcess]:
    service = start_service(
        "broadcast",
        ["--transfer_timeout_s", "5", "--rpc_margin_s", "2", "--heartbeat_timeout_s", "60"],
        log_dir=tmp_path,
        env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
    ).wait_ready(240)
    try:
        yield service
    finally:
        service.stop(10)


@pytest.fixture
def stub(broadcast: ServiceProcess) -> Iterator[broadcast_pb2_grpc.WeightBroadcastServiceStub]:
    with grpc.insecure_channel(broadcast.address) as chan:
        yield broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)


def _register(stub, worker_id: str, capacity: int) -> None:
    stub.RegisterWorker(
        pb.RegisterWorkerRequest(worker_id=worker_id, address="127.0.0.1:9", receive_capacity_bytes=capacity),
        metadata=AUTH,
        timeout=5,
    )


def _refused(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.PublishVersion(request, metadata=AUTH, timeout=10)
    return caught.value


def _status(stub) -> pb.WeightBroadcastServiceGetStatusResponse:
    return stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)


def test_a_version_no_worker_can_hold_is_refused_and_binds_nothing(stub) -> None:
    for request, field in [  # bad fields first: refused, nothing registered
        (pb.RegisterWorkerRequest(worker_id="w", address="127.0.0.1:9", receive_capacity_bytes=-1),
         "receive_capacity_bytes"),
        (_request(1, "tiny", TINY, publisher_id="no spaces allowed"), "publisher_id"),
        (_request(1, "tiny", TINY, publisher_id="x" * 129), "publisher_id"),
    ]:  # fmt: skip
        call = stub.RegisterWorker if isinstance(request, pb.RegisterWorkerRequest) else stub.PublishVersion
        with pytest.raises(grpc.RpcError) as caught:
            call(request, metadata=AUTH, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert caught.value.details().startswith(f"{field}:"), caught.value.details()
    _register(stub, "small-a", 23 * GIB)
    _register(stub, "small-b", 16 * GIB)
    error = _refused(stub, _request(1, "bogus", BOGUS))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert error.details().startswith("tensors:") and "small-a" in error.details(), error.details()
    status = _status(stub)
    assert list(status.versions) == [] and status.epoch == 0  # nothing changed
    # the real model, same number: accepted (it then fails: these workers answer nothing)
    plan = stub.PublishVersion(_request(1, "tiny", TINY), metadata=AUTH, timeout=10).plan
    assert plan.version == 1 and plan.rendezvous.world_size == 3


def test_a_version_to_no_worker_binds_nothing_and_one_worker_that_may_hold_it_admits_it(stub) -> None:
    stub.PublishVersion(_request(1, "bogus", BOGUS), metadata=AUTH, timeout=10)  # no worker: commits
    reply = stub.WaitVersion(
        pb.WaitVersionRequest(version=1, state=pb.VERSION_STATE_COMMITTED, timeout_s=10), timeout=20
    )
    assert reply.reached, reply
    plan = stub.PublishVersion(_request(2, "tiny", TINY), metadata=AUTH, timeout=10).plan  # not bound
    assert plan.version == 2
    reply = stub.WaitVersion(
        pb.WaitVersionRequest(version=2, state=pb.VERSION_STATE_COMMITTED, timeout_s=10), timeout=20
    )
    assert reply.reached, reply
    _register(stub, "small", 23 * GIB)
    _register(stub, "old-client", 0)  # capacity not reported: it may hold it
    plan = stub.PublishVersion(_request(3, "big", BOGUS), metadata=AUTH, timeout=10).plan
    assert plan.version == 3 and plan.rendezvous.world_size == 3


def test_waiting_for_workers_at_a_version_gives_up_on_time_and_counts_no_claims(
    broadcast: ServiceProcess, stub: broadcast_pb2_grpc.WeightBroadcastServiceStub
) -> None:
    """Publisher.wait_workers_at, as the trainer waits after its last step (trainer.await_workers):
    a worker counts once the service verified it holds the version (an applied update or
    catch-up, tests/test_resume.py covers that path); what a worker claims when it registers does
    not count. The wait ends at its timeout, or at once when told to stop."""
    import time

    from parity.weights.sender import Publisher

    publisher = Publisher(broadcast.address, "tiny", auth_token=TOKEN)
    try:
        stub.RegisterWorker(
            pb.RegisterWorkerRequest(worker_id="claims-v3", address="127.0.0.1:9", weight_version=3),
            metadata=AUTH,
            timeout=5,
        )
        assert [w.worker_id for w in _status(stub).workers] == ["claims-v3"]
        started = time.monotonic()
        assert publisher.wait_workers_at(2, 1, timeout_s=1.5) == 0
        assert 1.5 <= time.monotonic() - started < 10
        started = time.monotonic()
        assert publisher.wait_workers_at(2, 1, timeout_s=60, stop=lambda: True) == 0
        assert time.monotonic() - started < 10
        assert publisher.wait_workers_at(2, 0, timeout_s=60) == 0  # none expected: no wait, no call
    finally:
        publisher.close()
