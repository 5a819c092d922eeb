"""GPU paths of weight sync (marked `gpu`; skipped without CUDA -- not run on the CPU-only CI host).

- CUDA IPC: a producer process exports one packed CUDA buffer, a consumer process on the same GPU
  maps it without a copy and verifies every checksum (parity.weights.cuda_ipc).
- CUDA tensors over the data group: gloo on one GPU, sender and receiver in separate processes.
- The topology rule at runtime: two NCCL ranks on one GPU are refused before NCCL is touched.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

from parity.ports import free_port
from parity.v1 import common_pb2
from parity.weights import checksum

pytestmark = pytest.mark.gpu


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if not _cuda():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SECRET = "gpu-test-secret-0123456789abcdef"


def _named(device: str) -> list[tuple[str, object]]:
    import torch

    gen = torch.Generator().manual_seed(5)
    return [
        ("a", torch.randn(1024, 1024, generator=gen).to(device)),
        ("b", torch.randn(333, generator=gen).to(torch.bfloat16).to(device)),
        ("c", torch.randn(64, 64, generator=gen).to(device)),
    ]


def _consumer(handle_bytes: bytes, metas_bytes: list[bytes], results) -> None:
    try:
        import torch

        from parity.weights.cuda_ipc import import_buffer
        from parity.weights.layout import Layout, views

        metas = [common_pb2.TensorMeta.FromString(b) for b in metas_bytes]
        start = time.perf_counter()
        buffer = import_buffer(common_pb2.CudaIpcHandle.FromString(handle_bytes))
        torch.cuda.synchronize()
        map_s = time.perf_counter() - start
        tensors = views(buffer, metas, Layout.of(metas))
        results.put(("ok", checksum.mismatched(metas, tensors), map_s, buffer.data_ptr() != 0))
    except Exception:
        results.put(("error", traceback.format_exc(), 0.0, False))


def test_cuda_ipc_handoff_maps_the_producers_buffer_and_verifies() -> None:
    from parity.weights.cuda_ipc import export_buffer
    from parity.weights.layout import Layout, pack

    named = _named("cuda")
    metas = checksum.describe(named)
    buffer = pack([t for _, t in named], Layout.of(metas), device="cuda")
    handle = export_buffer(buffer)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(
        target=_consumer,
        args=(handle.SerializeToString(), [m.SerializeToString() for m in metas], results),
    )
    proc.start()
    status, bad, map_s, mapped = results.get(timeout=120)
    proc.join(30)
    assert status == "ok", bad
    assert bad == [] and mapped
    print(f"mapped {buffer.numel() / 2**20:.1f} MiB in {map_s * 1000:.2f} ms")


def _rank(rank: int, port: int, results) -> None:
    try:
        import torch

        from parity.weights.wire import TransferGroup

        rdv = common_pb2.Rendezvous(
            host="127.0.0.1", port=port, rank=rank, world_size=2, backend="gloo", group_name="gpu-gloo",
            timeout_s=60, secret=SECRET,
        )  # fmt: skip
        group = TransferGroup.join(rdv, host_store=rank == 0)
        named = _named("cuda")
        if rank == 0:
            group.send([t for _, t in named], 1 << 20)
            results.put((0, []))
        else:
            metas = checksum.describe(named)
            got = group.recv(metas, 1 << 20, device="cuda")
            assert all(t.is_cuda for t in got)
            torch.cuda.synchronize()
            results.put((1, checksum.mismatched(metas, got)))
        group.close()
    except Exception:
        results.put((rank, ["error: " + traceback.format_exc()]))


def test_cuda_tensors_over_the_data_group_gloo_on_one_gpu() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert outcome == {0: [], 1: []}, outcome


def _nccl_rank(rank: int, port: int, results) -> None:
    from parity.weights.layout import TransferError
    from parity.weights.wire import TransferGroup

    rdv = common_pb2.Rendezvous(
        host="127.0.0.1", port=port, rank=rank, world_size=2, backend="nccl", group_name="dup",
        timeout_s=30, secret=SECRET,
    )  # fmt: skip
    try:
        TransferGroup.join(rdv, host_store=rank == 0)
        results.put((rank, "joined"))
    except TransferError as exc:
        results.put((rank, str(exc)))


def test_two_nccl_ranks_on_one_gpu_are_refused_before_nccl() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    for message in outcome.values():
        assert "ranks 0 and 1 of this group are on the same GPU" in message, outcome


def _served(log_dir, worker_id: str) -> dict:
    import json

    return json.loads((log_dir / f"{worker_id}.json").read_text())


def _cuda_versions(version: int) -> list[tuple[str, object]]:
    from tests.test_broadcast import toy_weights

    return [(name, tensor.cuda()) for name, tensor in toy_weights(version)]


@pytest.mark.parametrize("with_group_worker", [False, True], ids=["ipc-only", "ipc-and-group"])
def test_update_weights_by_cuda_ipc_to_a_worker_on_the_trainers_gpu(
    tmp_path, with_group_worker: bool
) -> None:
    """The service path: a stand-in receiver on this GPU registers its device, the trainer's
    publisher (CUDA tensors) offers one packed buffer by IPC, the worker maps, copies and verifies it;
    with a CPU worker too, that one gets the same version over the gloo group in the same publish.
    Then a worker on this GPU joins late and gets the trainer's snapshot by IPC (catch-up), from the
    publisher that published it and from a restarted trainer's, which has published nothing."""
    import grpc

    from parity.procs import start_service
    from parity.v1 import broadcast_pb2 as pb
    from parity.v1 import broadcast_pb2_grpc
    from parity.weights.devices import cuda_device_uuid
    from parity.weights.sender import Publisher
    from tests.test_broadcast import TOKEN, start_standin

    broadcast = start_service(
        "broadcast",
        ["--transfer_timeout_s", "60"],
        log_dir=tmp_path,
        env={"PARITY_BROADCAST_AUTH_TOKEN": TOKEN},
    ).wait_ready(60)
    workers = {"gpu-w": start_standin(tmp_path, broadcast.address, "gpu-w", "--device", "cuda")}
    if with_group_worker:
        workers["cpu-w"] = start_standin(tmp_path, broadcast.address, "cpu-w")
    publisher = Publisher(broadcast.address, "toy", auth_token=TOKEN, wait_committed_s=60)
    try:
        for worker in workers.values():
            worker.wait_ready(120)
        for version in (1, 2):
            named = _cuda_versions(version)
            result = publisher.publish_tensors(named, version)
            assert result.committed, result
            expected = [str(m.checksum) for m in checksum.describe(named)]
            gpu = _served(tmp_path, "gpu-w")
            assert gpu["version"] == version and gpu["checksums"] == expected, gpu
            assert gpu["path"] == "cuda_ipc" and gpu["device"].startswith("cuda"), gpu
            if with_group_worker:
                cpu = _served(tmp_path, "cpu-w")
                assert (
                    cpu["version"] == version and cpu["checksums"] == expected and cpu["path"] == "group"
                ), cpu
            assert result.bytes_sent == (
                sum(t.numel() * t.element_size() for _, t in named) if with_group_worker else 0
            )
        # a worker on this GPU that joins late is caught up by the publisher's catch-up thread, by IPC
        workers["gpu-late"] = start_standin(tmp_path, broadcast.address, "gpu-late", "--device", "cuda")
        workers["gpu-late"].wait_ready(120)  # SERVING only once it holds the latest version
        late = _served(tmp_path, "gpu-late")
        assert late["version"] == 2 and late["checksums"] == expected and late["path"] == "cuda_ipc", late
        with grpc.insecure_channel(broadcast.address) as chan:
            status = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan).GetStatus(
                pb.WeightBroadcastServiceGetStatusRequest(), timeout=5
            )
        info = {w.worker_id: w for w in status.workers}
        assert info["gpu-w"].device_uuid == cuda_device_uuid() and info["gpu-w"].verified
        assert info["gpu-w"].weight_version == 2
        assert info["gpu-late"].verified and info["gpu-late"].weight_version == 2
        assert list(status.epoch_members) == (["cpu-w"] if with_group_worker else [])
        # A restarted trainer: a new publisher that has published nothing yet serves version 2's
        # catch-up, and a worker on this GPU that joins now gets it by IPC too.
        publisher.close()
        publisher = Publisher(broadcast.address, "toy", auth_token=TOKEN, wait_committed_s=60)
        publisher.serve_catch_up(2, _cuda_versions(2))
        workers["gpu-after"] = start_standin(tmp_path, broadcast.address, "gpu-after", "--device", "cuda")
        workers["gpu-after"].wait_ready(120)
        after = _served(tmp_path, "gpu-after")
        assert after["version"] == 2 and after["checksums"] == expected and after["path"] == "cuda_ipc", after
        print(f"ipc path ok ({'with' if with_group_worker else 'without'} a group worker)")
    finally:
        publisher.close()
        for worker in workers.values():
            worker.stop(10)
        broadcast.stop(10)
