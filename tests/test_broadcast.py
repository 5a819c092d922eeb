"""Weight sync v2 end to end: real processes, real gRPC, real gloo.

One broadcast service (the control plane) and two stand-in receivers (tests/fakes/fake_receiver.py:
the receiving half of the update protocol without an engine, with the rollout workers' own
receiver) are shared by the tests in this module, in order; this test process is the trainer, rank 0
of the epoch's data group, which it holds across versions. Versions continue across tests.
Failure cases (killed receivers and trainers, late joiners) are in tests/test_weight_sync_chaos.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from parity.ports import free_port
from parity.procs import ServiceProcess, start_service
from parity.server import bearer
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2
from parity.weights import checksum
from parity.weights.group import GroupHolder

TOKEN = "test-token"
MODEL = "toy"
BUCKET_BYTES = 256 * 1024
CORRUPT_AT = (2, "layers.0.w")  # receiver r0 flips a byte of this tensor when it receives version 2


def toy_weights(version: int) -> list[tuple[str, object]]:
    """About 1.2 MB over four tensors, two dtypes; different values per version."""
    import torch

    gen = torch.Generator().manual_seed(1000 + version)
    return [
        ("embed.weight", torch.randn(1000, 256, generator=gen)),
        ("layers.0.w", torch.randn(256, 256, generator=gen).to(torch.bfloat16)),
        ("norm.weight", torch.randn(256, generator=gen)),
        ("head.bias", torch.randn(1000, generator=gen)),
    ]


def publish_request(version: int, named=None, model: str = MODEL) -> pb.PublishVersionRequest:
    named = toy_weights(version) if named is None else named
    return pb.PublishVersionRequest(
        version=version,
        model=model,
        tensors=checksum.describe(named),
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
        bucket_bytes=BUCKET_BYTES,
    )


TRAINER_GROUPS = GroupHolder()  # the trainer's epoch group, held across versions as the sender does


def publish(
    stub: broadcast_pb2_grpc.WeightBroadcastServiceStub, version: int, world_size: int = 3
) -> common_pb2.TransferPlan:
    """The trainer's side: announce, broadcast once to the epoch's workers, wait until a worker has
    verified it (COMMITTED). Returns the plan it sent by."""
    named = toy_weights(version)
    plan = stub.PublishVersion(publish_request(version, named), metadata=bearer(TOKEN), timeout=10).plan
    assert plan.rendezvous.rank == 0 and plan.rendezvous.world_size == world_size
    assert len(plan.rendezvous.secret) >= 16
    with TRAINER_GROUPS.use(plan.rendezvous) as group:
        sent = group.send([t for _, t in named], plan.bucket_bytes)
    assert sent >= sum(t.numel() * t.element_size() for _, t in named)
    committed = stub.WaitVersion(
        pb.WaitVersionRequest(version=version, state=pb.VERSION_STATE_COMMITTED, timeout_s=30), timeout=40
    )
    assert committed.reached, committed
    return plan


def wait_distributed(stub, version: int, timeout_s: float = 60) -> pb.VersionInfo:
    reply = stub.WaitVersion(
        pb.WaitVersionRequest(version=version, state=pb.VERSION_STATE_DISTRIBUTED, timeout_s=timeout_s),
        timeout=timeout_s + 10,
    )
    assert reply.reached, reply
    return reply.version


def trainer_checksums(version: int) -> list[str]:
    return [str(m.checksum) for m in checksum.describe(toy_weights(version))]


def workers(stub) -> dict[str, pb.WorkerInfo]:
    return {
        w.worker_id: w for w in stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5).workers
    }


def start_standin(log_dir: Path, broadcast: str, worker_id: str, *extra: str) -> ServiceProcess:
    """A stand-in receiver subprocess (its port file appears once it serves the latest version)."""
    port_file = log_dir / f"{worker_id}.port"
    port_file.unlink(missing_ok=True)
    log_path = log_dir / f"{worker_id}.log"
    cmd = [
        sys.executable,
        "-m",
        "tests.fakes.fake_receiver",
        "--broadcast_address",
        broadcast,
        "--worker_id",
        worker_id,
        "--auth_token",
        TOKEN,
        "--port_file",
        str(port_file),
        "--state_file",
        str(log_dir / f"{worker_id}.json"),
        *extra,
    ]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return ServiceProcess(name=worker_id, proc=proc, port_file=port_file, log_path=log_path)


def state(log_dir: Path, worker_id: str) -> dict:
    """The stand-in's served version and checksums (how they came is checked where it matters)."""
    served = json.loads((log_dir / f"{worker_id}.json").read_text())
    return {"version": served["version"], "checksums": served["checksums"]}


class Cluster:
    def __init__(self, log_dir: Path, broadcast: ServiceProcess, metrics_port: int) -> None:
        self.log_dir = log_dir
        self.broadcast = broadcast
        self.metrics_port = metrics_port
        self.channel = grpc.insecure_channel(broadcast.address)
        self.stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self.channel)
        self.receivers: dict[str, ServiceProcess] = {}

    def add(self, worker_id: str, *extra: str, wait: bool = True) -> ServiceProcess:
        receiver = start_standin(self.log_dir, self.broadcast.address, worker_id, *extra)
        self.receivers[worker_id] = receiver
        if wait:
            receiver.wait_ready(240)
        return receiver

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    def latest(self) -> int:
        return self.stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5).latest_version


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("broadcast")
    metrics_port = free_port()
    broadcast = start_service(
        "broadcast",
        [
            "--heartbeat_interval_s",
            "0.5",
            # Long enough that a stand-in starved of CPU on a loaded box is not dropped: no test here
            # needs a drop, and at 3 s a fresh-clone suite run saw both stand-ins dropped mid-module.
            "--heartbeat_timeout_s",
            "30",
            "--transfer_timeout_s",
            "10",
            "--retry_failed_after_s",
            "2",
            "--metrics_port",
            str(metrics_port),
        ],
        log_dir=log_dir,
        env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
    ).wait_ready(240)
    env = Cluster(log_dir, broadcast, metrics_port)
    fault = f"{CORRUPT_AT[0]}={CORRUPT_AT[1]}"
    env.add("r0", "--enable_fault_injection", "--corrupt_tensor_at", fault, wait=False)
    env.add("r1", wait=False)
    for receiver in env.receivers.values():
        receiver.wait_ready(240)
    yield env
    env.channel.close()
    TRAINER_GROUPS.close()
    for receiver in env.receivers.values():
        receiver.stop(10)
    broadcast.stop(10)


@pytest.mark.slow
def test_publish_reaches_every_receiver_with_the_trainers_checksums(cluster: Cluster) -> None:
    plan = publish(cluster.stub, 1)
    info = wait_distributed(cluster.stub, 1)
    assert info.num_tensors == 4 and info.total_bytes == 1000 * 256 * 4 + 256 * 256 * 2 + 256 * 4 + 1000 * 4
    for worker_id in ("r0", "r1"):
        assert state(cluster.log_dir, worker_id) == {"version": 1, "checksums": trainer_checksums(1)}
    status = cluster.stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)
    assert status.epoch >= 1 and sorted(status.epoch_members) == ["r0", "r1"]
    assert plan.rendezvous.group_name.startswith(f"epoch{status.epoch}-")
    assert {w.worker_id: (w.weight_version, w.state, w.verified, w.epoch) for w in status.workers} == {
        "r0": (1, pb.WORKER_STATE_SERVING, True, status.epoch),
        "r1": (1, pb.WORKER_STATE_SERVING, True, status.epoch),
    }
    text = cluster.metrics()
    assert "parity_broadcast_latest_version 1.0" in text
    received = next(line for line in text.splitlines() if line.startswith("parity_broadcast_bytes_total{"))
    assert float(received.split()[-1]) == 2 * info.total_bytes  # two verified acks
    assert "parity_broadcast_update_duration_seconds_count 2.0" in text


@pytest.mark.slow
def test_corrupted_tensor_is_detected_receiver_keeps_old_weights_next_version_applies(
    cluster: Cluster,
) -> None:
    version, tensor = CORRUPT_AT
    reach(cluster, version - 1)
    assert cluster.latest() == version - 1
    epoch = cluster.stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5).epoch
    publish(cluster.stub, version)
    wait_distributed(cluster.stub, version)  # r1 verified it: a failure of one worker is not the version's
    assert state(cluster.log_dir, "r0") == {
        "version": version - 1,
        "checksums": trainer_checksums(version - 1),
    }
    assert state(cluster.log_dir, "r1") == {"version": version, "checksums": trainer_checksums(version)}
    r0 = workers(cluster.stub)["r0"]
    assert r0.state == pb.WORKER_STATE_FAILED and r0.weight_version == version - 1
    assert tensor in r0.last_error and "checksum" in r0.last_error
    assert 'parity_broadcast_update_failures_total{reason="checksum"} 1.0' in cluster.metrics()
    plan = publish(cluster.stub, version + 1)  # a group that saw a failure is never reused
    wait_distributed(cluster.stub, version + 1)
    assert plan.rendezvous.group_name.startswith(f"epoch{epoch + 1}-")
    for worker_id in ("r0", "r1"):
        assert state(cluster.log_dir, worker_id) == {
            "version": version + 1,
            "checksums": trainer_checksums(version + 1),
        }
    assert workers(cluster.stub)["r0"].state == pb.WORKER_STATE_SERVING


def reach(cluster: Cluster, version: int) -> None:
    """Publish and distribute every version up to `version` that this module's earlier tests did
    not, so each test also runs alone (`-k`) from the state it expects."""
    while (latest := cluster.latest()) < version:
        publish(cluster.stub, latest + 1)
        wait_distributed(cluster.stub, latest + 1)


def _expect(code: grpc.StatusCode, call: Callable[[], object], field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    assert field in caught.value.details()


@pytest.mark.slow
def test_bad_metadata_backwards_versions_and_missing_token_are_rejected(cluster: Cluster) -> None:
    import torch

    reach(cluster, 1)  # the schema a version is checked against is the first published one's
    stub, latest = cluster.stub, cluster.latest()
    auth = bearer(TOKEN)
    good = toy_weights(latest + 1)

    def with_tensor(index: int, tensor) -> list:
        named = list(good)
        named[index] = (named[index][0], tensor)
        return named

    cases = [
        (with_tensor(0, torch.zeros(999, 256)), "tensors[0].shape"),
        (with_tensor(1, torch.zeros(256, 256)), "tensors[1].dtype"),
        ([*good[:3], ("head.extra", torch.zeros(1000))], "tensors[3].name"),
        (good[:3], "tensors"),
    ]
    for named, field in cases:
        _expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda named=named: stub.PublishVersion(
                publish_request(latest + 1, named), metadata=auth, timeout=5
            ),
            field,
        )
    _expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.PublishVersion(publish_request(latest + 1, model="other"), metadata=auth, timeout=5),
        "model",
    )
    _expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: stub.PublishVersion(publish_request(latest), metadata=auth, timeout=5),
        "goes backwards",
    )
    _expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: stub.PublishVersion(publish_request(latest + 2), metadata=auth, timeout=5),
        "version",
    )
    _expect(
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: stub.PublishVersion(publish_request(latest + 1), timeout=5),
        "PublishVersion",
    )
    _expect(
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: stub.PublishVersion(publish_request(latest + 1), metadata=bearer("wrong"), timeout=5),
        "PublishVersion",
    )
    register = pb.RegisterWorkerRequest(worker_id="intruder", address="127.0.0.1:1", weight_version=0)
    _expect(
        grpc.StatusCode.UNAUTHENTICATED, lambda: stub.RegisterWorker(register, timeout=5), "RegisterWorker"
    )
    bad_address = pb.RegisterWorkerRequest(worker_id="x", address="nowhere", weight_version=0)
    _expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.RegisterWorker(bad_address, metadata=auth, timeout=5),
        "address",
    )
    _expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.WaitVersion(pb.WaitVersionRequest(version=1, timeout_s=1), timeout=5),
        "state",
    )
    for bad in (float("nan"), float("inf"), 1e30):
        wait = pb.WaitVersionRequest(version=1, state=pb.VERSION_STATE_COMMITTED, timeout_s=bad)
        _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda w=wait: stub.WaitVersion(w, timeout=5), "timeout_s")
        catch_up = pb.AwaitCatchUpRequest(have_version=latest, timeout_s=bad)
        _expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda c=catch_up: stub.AwaitCatchUp(c, metadata=auth, timeout=5),
            "timeout_s",
        )
    _expect(
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: stub.AwaitCatchUp(pb.AwaitCatchUpRequest(have_version=latest), timeout=5),
        "AwaitCatchUp",
    )
    # Heartbeat needs the token, and a worker's version comes from verified acks, never a self-report
    boast = pb.HeartbeatRequest(worker_id="r1", weight_version=10**15)
    _expect(grpc.StatusCode.UNAUTHENTICATED, lambda: stub.Heartbeat(boast, timeout=5), "Heartbeat")
    stub.Heartbeat(boast, metadata=auth, timeout=5)
    assert workers(stub)["r1"].weight_version == latest
    # nothing above changed the registry, and the service still serves
    status = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)
    assert status.latest_version == latest
    assert max(v.version for v in status.versions) == latest
    assert set(workers(stub)) == {"r0", "r1"}


@pytest.mark.slow
def test_three_quick_versions_end_on_newest_never_backwards_none_twice(cluster: Cluster) -> None:
    reach(cluster, CORRUPT_AT[0])  # past the failed version, so the three share one epoch
    first = cluster.latest() + 1
    events: list[pb.VersionEvent] = []
    watch = cluster.stub.WatchVersions(pb.WatchVersionsRequest(after_version=first - 1), timeout=120)
    only = [pb.VERSION_EVENT_KIND_PUBLISHED, pb.VERSION_EVENT_KIND_DISTRIBUTED]
    filtered = cluster.stub.WatchVersions(
        pb.WatchVersionsRequest(after_version=first - 1, kinds=only), timeout=120
    )
    groups, names = [], set()
    for version in range(first, first + 3):
        names.add(publish(cluster.stub, version).rendezvous.group_name)
        groups.append(TRAINER_GROUPS.group)
    last = first + 2
    # one membership epoch: one group, joined once and reused for every version
    assert len(names) == 1 and groups[0] is groups[1] is groups[2]
    wait_distributed(cluster.stub, last)
    for response in watch:
        events.append(response.event)
        if response.event.kind == pb.VERSION_EVENT_KIND_DISTRIBUTED and response.event.version == last:
            break
    watch.cancel()
    for worker_id in ("r0", "r1"):
        applied = [
            e.version
            for e in events
            if e.kind == pb.VERSION_EVENT_KIND_WORKER_UPDATED and e.worker_id == worker_id
        ]
        assert applied, f"{worker_id} applied nothing"
        assert applied == sorted(set(applied)), f"{worker_id} applied {applied}: backwards or twice"
        assert applied[-1] == last
        assert state(cluster.log_dir, worker_id) == {"version": last, "checksums": trainer_checksums(last)}
    published = [e.version for e in events if e.kind == pb.VERSION_EVENT_KIND_PUBLISHED]
    assert published == [first, first + 1, first + 2]
    # a watcher that asked for two kinds gets exactly those events, in the same order
    seen: list[pb.VersionEvent] = []
    for response in filtered:
        seen.append(response.event)
        if response.event.kind == pb.VERSION_EVENT_KIND_DISTRIBUTED and response.event.version == last:
            break
    filtered.cancel()
    assert [(e.kind, e.version) for e in seen] == [(e.kind, e.version) for e in events if e.kind in only]
    with pytest.raises(grpc.RpcError) as bad:
        next(iter(cluster.stub.WatchVersions(pb.WatchVersionsRequest(kinds=[99]), timeout=10)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kinds" in bad.value.details()


def test_the_store_binds_its_own_address_and_peers_are_told_the_advertised_one(tmp_path: Path) -> None:
    """broadcast.data_host is what peers are told (a Kubernetes Service name, here an address that
    is not this host's); broadcast.data_bind_host is where the TCPStore listens."""
    from parity.procs import start_service

    service = start_service(
        "broadcast",
        ["--data_host", "192.0.2.7", "--data_bind_host", "127.0.0.1", "--store_port", "0"],
        log_dir=tmp_path,
        name="bind",
    )
    try:
        service.wait_ready(120)  # binding 192.0.2.7 would fail: "cannot assign requested address"
        assert "store 192.0.2.7:" in service.log_tail() and "bound on 127.0.0.1" in service.log_tail()
    finally:
        service.stop(10)


def test_update_timings_are_unset_until_measured_not_zero() -> None:
    """A worker's last update and pause times: unset before any attempt, and the pause unset after
    an attempt the worker never answered (0.0 would read as 'updated without pausing')."""
    from broadcast.membership import WorkerRecord

    record = WorkerRecord("w0", "127.0.0.1:1", 0)
    fresh = record.info()
    assert not fresh.HasField("last_update_seconds") and not fresh.HasField("last_paused_seconds")
    record.last_update_seconds, record.last_paused_seconds = 1.25, 0.0
    measured = record.info()
    assert measured.HasField("last_paused_seconds") and measured.last_paused_seconds == 0.0
    assert measured.last_update_seconds == 1.25
