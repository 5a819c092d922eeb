"""The same-GPU path of weight sync, its control plane on CPU: workers registered on the trainer's GPU
are kept out of the data group and get each version by CUDA IPC (the trainer's OfferIpcBuffer).

CUDA itself cannot run here, so the worker on the "trainer's GPU" is `RecordingWorker`, a fake
RolloutService in this process that records the UpdateWeights it is sent and acks the trainer's
checksums (it cannot map a CUDA buffer). The other worker is the real stand-in receiver over gloo.
The mapping itself, end to end with the real receiver on a GPU, is tests/test_weight_sync_gpu.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from parity.procs import start_service
from parity.server import bearer
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.test_broadcast import TOKEN, publish_request, start_standin, toy_weights

GPU = "GPU-0b1c2d3e-test-0000-0000-000000000001"  # the trainer's (and the recording worker's) GPU
TRANSFER_TIMEOUT_S = 4


class RecordingWorker(rollout_pb2_grpc.RolloutServiceServicer):
    """A fake worker on the trainer's GPU: records each UpdateWeights, acks with the plan's own
    checksums (what a worker that mapped and verified the buffer would report)."""

    def __init__(self) -> None:
        self.requests: list[rollout_pb2.UpdateWeightsRequest] = []
        self.seen = threading.Event()

    def UpdateWeights(self, request, context):
        self.requests.append(request)
        self.seen.set()
        return rollout_pb2.UpdateWeightsResponse(
            outcome=rollout_pb2.UPDATE_OUTCOME_APPLIED,
            weight_version=request.plan.version,
            checksums=[m.checksum for m in request.plan.tensors],
        )


class Env:
    def __init__(self, log_dir: Path, address: str, recorder: RecordingWorker) -> None:
        self.log_dir = log_dir
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self.channel)
        self.recorder = recorder

    def status(self) -> pb.WeightBroadcastServiceGetStatusResponse:
        return self.stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)

    def offer(self, version: int, handle: common_pb2.CudaIpcHandle | None, token: str = TOKEN):
        request = pb.OfferIpcBufferRequest(version=version, handle=handle)
        return self.stub.OfferIpcBuffer(request, metadata=bearer(token) if token else (), timeout=5)

    def wait(self, version: int, timeout_s: float = 30) -> pb.WaitVersionResponse:
        request = pb.WaitVersionRequest(
            version=version, state=pb.VERSION_STATE_DISTRIBUTED, timeout_s=timeout_s
        )
        return self.stub.WaitVersion(request, timeout=timeout_s + 10)


def handle_for(nbytes: int, device_uuid: str = GPU) -> common_pb2.CudaIpcHandle:
    """A well-formed handle (what `parity.weights.cuda_ipc.export_buffer` gives); its bytes map
    nothing here."""
    return common_pb2.CudaIpcHandle(
        nbytes=nbytes,
        device_index=0,
        storage_handle=b"\x01" * 64,
        storage_size_bytes=nbytes,
        ref_counter_handle=b"\x02" * 16,
        device_uuid=device_uuid,
        timeout_s=TRANSFER_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    log_dir = tmp_path_factory.mktemp("ipc")
    broadcast = start_service(
        "broadcast",
        ["--heartbeat_timeout_s", "600", "--transfer_timeout_s", str(TRANSFER_TIMEOUT_S)],
        log_dir=log_dir,
        env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
    ).wait_ready(240)
    recorder = RecordingWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    standin = start_standin(log_dir, broadcast.address, "cpu-w")
    try:
        standin.wait_ready(240)
        e = Env(log_dir, broadcast.address, recorder)
        e.stub.RegisterWorker(
            pb.RegisterWorkerRequest(worker_id="gpu-w", address=f"127.0.0.1:{port}", device_uuid=GPU),
            metadata=bearer(TOKEN),
            timeout=5,
        )
        yield e
        e.channel.close()
    finally:
        standin.stop(10)
        server.stop(1)
        broadcast.stop(10)


def publish_from_gpu(env: Env, version: int) -> tuple[pb.PublishVersionResponse, list]:
    """The trainer's side, from "the GPU": announce, then send the group's share over gloo."""
    from tests.test_broadcast import TRAINER_GROUPS

    named = toy_weights(version)
    request = publish_request(version, named)
    request.device_uuid = GPU
    reply = env.stub.PublishVersion(request, metadata=bearer(TOKEN), timeout=10)
    with TRAINER_GROUPS.use(reply.plan.rendezvous) as group:
        group.send([t for _, t in named], reply.plan.bucket_bytes)
    return reply, named


def nbytes_of(version: int) -> int:
    return sum(t.numel() * t.element_size() for _, t in toy_weights(version))


def settle_next(env: Env) -> int:
    """Publish the next version and hand its buffer over, so each test starts from a version every
    worker holds whatever ran before it (the module's services are shared)."""
    version = env.status().latest_version + 1
    publish_from_gpu(env, version)
    env.offer(version, handle_for(nbytes_of(version)))
    assert env.wait(version).reached
    return version


def test_a_worker_on_the_trainers_gpu_gets_the_handle_not_a_rank(env: Env) -> None:
    version = env.status().latest_version + 1
    env.recorder.seen.clear()
    reply, _ = publish_from_gpu(env, version)
    assert reply.ipc_workers == 1
    # the group is the trainer and the CPU worker only: no two ranks of one group on one GPU
    assert reply.plan.rendezvous.world_size == 2
    sent = handle_for(nbytes_of(version))
    assert env.offer(version, sent).ipc_workers == 1
    assert env.recorder.seen.wait(10)
    got = env.recorder.requests[-1].plan
    assert got.version == version and got.cuda_ipc == sent and not got.HasField("rendezvous")
    assert [m.checksum for m in got.tensors] == [m.checksum for m in reply.plan.tensors]
    final = env.wait(version)
    assert final.reached and final.version.state == pb.VERSION_STATE_DISTRIBUTED
    workers = {w.worker_id: w for w in env.status().workers}
    assert workers["gpu-w"].verified and workers["gpu-w"].weight_version == version
    assert workers["gpu-w"].device_uuid == GPU and workers["cpu-w"].device_uuid == ""
    assert workers["cpu-w"].verified and workers["cpu-w"].weight_version == version
    assert list(env.status().epoch_members) == ["cpu-w"]


def test_bad_ipc_offers_are_refused_naming_the_field(env: Env) -> None:
    settled = settle_next(env)
    nbytes = nbytes_of(settled)
    cases = [
        (pb.OfferIpcBufferRequest(version=settled), grpc.StatusCode.INVALID_ARGUMENT, "handle: required"),
        (
            pb.OfferIpcBufferRequest(
                version=settled, handle=common_pb2.CudaIpcHandle(nbytes=nbytes, device_uuid=GPU)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "handle.storage_handle",
        ),
        (
            pb.OfferIpcBufferRequest(version=settled + 99, handle=handle_for(nbytes)),
            grpc.StatusCode.NOT_FOUND,
            "version",
        ),
        (
            pb.OfferIpcBufferRequest(version=settled, handle=handle_for(nbytes, "GPU-another")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "handle.device_uuid",
        ),
        # settled: nobody waits for its buffer any more (and an offer is taken once)
        (
            pb.OfferIpcBufferRequest(version=settled, handle=handle_for(nbytes)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "version",
        ),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.RpcError) as caught:
            env.stub.OfferIpcBuffer(request, metadata=bearer(TOKEN), timeout=5)
        assert caught.value.code() == code, (request, caught.value.details())
        assert caught.value.details().startswith(field), caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:  # it hands a buffer to workers: token required
        env.offer(settled, handle_for(nbytes), token="")
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert env.status().latest_version == settled  # nothing changed, the service is up


def test_no_offer_fails_the_gpu_worker_within_the_timeout_and_the_next_version_succeeds(env: Env) -> None:
    held = settle_next(env)
    env.recorder.seen.clear()
    start = time.monotonic()
    publish_from_gpu(env, held + 1)  # and never a usable offer: a trainer that died after publishing
    with pytest.raises(grpc.RpcError) as caught:  # a wrong size is refused and takes nothing away
        env.offer(held + 1, handle_for(nbytes_of(held + 1) + 8))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("handle.nbytes"), caught.value.details()
    final = env.wait(held + 1, timeout_s=TRANSFER_TIMEOUT_S + 20)
    waited = time.monotonic() - start
    assert final.reached, final
    assert TRANSFER_TIMEOUT_S - 0.5 <= waited <= TRANSFER_TIMEOUT_S + 15
    assert not env.recorder.seen.is_set()  # no UpdateWeights without a handle
    workers = {w.worker_id: w for w in env.status().workers}
    assert workers["gpu-w"].state == pb.WORKER_STATE_FAILED
    assert "timed out" in workers["gpu-w"].last_error and "OfferIpcBuffer" in workers["gpu-w"].last_error
    assert workers["gpu-w"].weight_version == held  # kept its verified version
    assert workers["cpu-w"].weight_version == held + 1  # the group's worker was not held back
    reply, _ = publish_from_gpu(env, held + 2)
    env.offer(held + 2, handle_for(nbytes_of(held + 2)))
    assert env.wait(held + 2).reached
    workers = {w.worker_id: w for w in env.status().workers}
    assert workers["gpu-w"].weight_version == held + 2 and workers["gpu-w"].verified
    assert reply.ipc_workers == 1


def test_membership_splits_the_epoch_by_the_trainers_gpu() -> None:
    from broadcast.membership import Membership
    from parity.errors import RequestError

    members = Membership(max_workers=8, heartbeat_timeout_s=60, exclude_s=5)
    for wid, uuid in (("a", GPU), ("b", "GPU-other"), ("c", "")):
        members.register(pb.RegisterWorkerRequest(worker_id=wid, address="127.0.0.1:1", device_uuid=uuid))
    epoch, new = members.current_epoch(GPU)
    assert new and epoch.members == ("b", "c") and epoch.ipc_members == ("a",)
    assert members.current_epoch(GPU) == (epoch, False)  # held across versions
    cpu_epoch, new = members.current_epoch("")  # a trainer on CPU: every worker is a rank
    assert new and cpu_epoch.members == ("a", "b", "c") and cpu_epoch.ipc_members == ()
    with pytest.raises(RequestError) as caught:
        members.register(pb.RegisterWorkerRequest(worker_id="d", address="127.0.0.1:1", device_uuid="GPU 0;"))
    assert caught.value.field == "device_uuid"


def test_a_rollout_worker_validates_an_ipc_plan_and_fails_cleanly_without_cuda() -> None:
    from parity.errors import RequestError
    from parity.weights import checksum
    from parity.weights.receiver import receive_and_verify
    from rollout.validation import check_update_request

    named = toy_weights(1)
    metas = checksum.describe(named)
    shapes = {m.name: tuple(m.shape) for m in metas}
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    plan = common_pb2.TransferPlan(
        version=1, tensors=metas, bucket_bytes=1 << 20, cuda_ipc=handle_for(nbytes)
    )
    check_update_request(rollout_pb2.UpdateWeightsRequest(plan=plan), shapes, False)  # valid
    both = common_pb2.TransferPlan()
    both.CopyFrom(plan)
    both.rendezvous.CopyFrom(common_pb2.Rendezvous(host="127.0.0.1", port=1, rank=1, world_size=2))
    no_handle = common_pb2.TransferPlan()
    no_handle.CopyFrom(plan)
    no_handle.cuda_ipc.storage_handle = b""
    for bad, field in ((both, "plan.rendezvous"), (no_handle, "plan.cuda_ipc.storage_handle")):
        with pytest.raises(RequestError) as caught:
            check_update_request(rollout_pb2.UpdateWeightsRequest(plan=bad), shapes, False)
        assert caught.value.field == field
    # this host sees no such GPU: the handoff fails with a clear error and nothing is staged
    staged = receive_and_verify(plan, "cpu")
    assert "CUDA IPC handoff of version 1 failed" in staged.error and GPU in staged.error
    assert staged.tensors == []


def start_recording_worker() -> tuple[RecordingWorker, grpc.Server, int]:
    """A RecordingWorker served over gRPC on a free loopback port: (worker, server, port)."""
    worker = RecordingWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return worker, server, port


def test_a_late_worker_on_the_trainers_gpu_catches_up_by_ipc(env: Env) -> None:
    latest = settle_next(env)  # a version published before the late worker registers
    late, server, port = start_recording_worker()
    try:
        env.stub.RegisterWorker(
            pb.RegisterWorkerRequest(worker_id="gpu-late", address=f"127.0.0.1:{port}", device_uuid=GPU),
            metadata=bearer(TOKEN),
            timeout=5,
        )
        reply = env.stub.AwaitCatchUp(
            pb.AwaitCatchUpRequest(have_version=latest, timeout_s=10), metadata=bearer(TOKEN), timeout=20
        )
        assert reply.HasField("plan") and reply.ipc_workers == 1, reply
        assert reply.plan.rendezvous.world_size == 1  # nobody else is behind: no group to send to
        whole = nbytes_of(latest)
        assert env.offer(latest, handle_for(whole)).ipc_workers == 1
        assert late.seen.wait(10)
        got = late.requests[-1].plan
        assert got.version == latest and got.cuda_ipc.nbytes == whole and got.base_version == 0
        assert not got.HasField("rendezvous")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = {w.worker_id: w for w in env.status().workers}["gpu-late"]
            if info.verified and info.weight_version == latest:
                break
            time.sleep(0.1)
        assert info.verified and info.weight_version == latest, info
    finally:
        server.stop(1)


def test_a_restarted_trainers_publisher_catches_up_a_worker_on_its_gpu_by_ipc(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted trainer's Publisher has published nothing: it only serves the latest version's
    catch-up (`serve_catch_up`, as the trainer does at start). A worker on its GPU that registers
    then gets that version by an IPC offer, as after a publish. Fakes for what needs CUDA: the
    tensors are said to be on the GPU (`_device_uuid`), the packed buffer stays on the CPU, and its
    handle is `handle_for` (the recording worker maps nothing)."""
    import torch

    from parity.weights import sender

    latest = settle_next(env)
    monkeypatch.setattr(sender, "_device_uuid", lambda named: GPU if named else "")
    real_pack = sender.pack
    monkeypatch.setattr(
        sender, "pack", lambda ordered, layout, device: real_pack(ordered, layout, device="cpu")
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(
        sender,
        "export_buffer",
        lambda buffer, uuid, timeout_s: handle_for(buffer.numel() * buffer.element_size(), uuid),
    )
    publisher = sender.Publisher(env.address, "toy", auth_token=TOKEN)
    late, server, port = start_recording_worker()
    try:
        publisher.serve_catch_up(latest, toy_weights(latest))
        env.stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id="gpu-after-restart", address=f"127.0.0.1:{port}", device_uuid=GPU
            ),
            metadata=bearer(TOKEN),
            timeout=5,
        )
        assert late.seen.wait(30), "the restarted trainer's publisher offered no IPC buffer"
        got = late.requests[-1].plan
        assert got.version == latest and got.cuda_ipc.nbytes == nbytes_of(latest), got
        deadline = time.monotonic() + 30  # the catch-up counts once the worker acked
        while publisher.catch_ups_sent == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert publisher.catch_ups_sent == 1
    finally:
        publisher.close()
        env.stub.UnregisterWorker(
            pb.UnregisterWorkerRequest(worker_id="gpu-after-restart"), metadata=bearer(TOKEN), timeout=5
        )
        server.stop(1)
