"""Weight-sync benchmark: end-to-end update through the broadcast service vs a raw gloo broadcast.

    python bench/weight_sync.py                      # SmolLM2-135M (fp32, ~540 MB) + a 1 GiB random model
    python bench/weight_sync.py --large_mb 0 --repeats 5

For each model, in the same run and on the same machine:
- raw:  one gloo broadcast (bucketed, pre-allocated buffers) of the same bytes from a sender process to
        `--receivers` receiver processes: the floor for moving these bytes with torch.distributed;
- e2e:  the trainer stand-in (this process) publishes version v to a real broadcast service, sends it
        once, and the clock stops when the last receiver has verified, swapped and resumed
        (WaitVersion DISTRIBUTED). Receivers are stand-in rollout workers
        (services/broadcast/standin_receiver.py): same protocol and checksums, no engine;
- stall: the longest paused time a receiver reported for that update;
- trainer cost: publish + send, i.e. until the trainer may train again.
It also measures WSUM64 checksum cost (ms per 100 MB). Goal: e2e / raw <= 1.5.
The final stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from parity import checksum
from parity.procs import ServiceProcess, start_service
from parity.transport import Layout, TransferGroup, free_port
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2


def log(message: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {message}", flush=True)


def smollm2_weights() -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    from parity import models

    path = models.resolve("smollm2-135m") / "model.safetensors"
    return sorted(load_file(str(path)).items())


def random_weights(total_mb: int, seed: int = 0) -> list[tuple[str, object]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = 4096
    per_tensor = 64 * 1024 * 1024  # 64 MiB tensors of float32
    count = max(1, total_mb * 1024 * 1024 // per_tensor)
    return [
        (f"layer{i}.weight", torch.rand(rows, per_tensor // 4 // rows, generator=gen)) for i in range(count)
    ]


def bump(named: list[tuple[str, object]], version: int) -> None:
    """Make version v's values differ from v-1 (cheap: one element per tensor)."""
    for _, tensor in named:
        tensor.view(-1)[0] = float(version)


# -- raw baseline ------------------------------------------------------------------------------
def _raw_receiver(rank: int, world: int, port: int, total: int, bucket: int, repeats: int, q) -> None:
    import torch

    metas = [common_pb2.TensorMeta(name="flat", shape=[total], dtype="uint8")]
    rdv = common_pb2.Rendezvous(
        host="127.0.0.1",
        port=port,
        rank=rank,
        world_size=world,
        backend="gloo",
        group_name="raw",
        timeout_s=300,
    )
    group = TransferGroup.join(rdv)
    out = torch.empty(total, dtype=torch.uint8)
    out.fill_(0)  # pre-fault pages: the raw baseline measures the wire, not page faults
    for _ in range(repeats + 1):
        group.recv_packed(metas, bucket, out=out)
    group.close()
    q.put(rank)


def raw_broadcast(total: int, receivers: int, bucket: int, repeats: int) -> float:
    """Median seconds of a bucketed gloo broadcast of `total` bytes to `receivers` processes."""
    import torch

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    world = receivers + 1
    procs = [
        ctx.Process(target=_raw_receiver, args=(r, world, port, total, bucket, repeats, q))
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    rdv = common_pb2.Rendezvous(
        host="127.0.0.1", port=port, rank=0, world_size=world, backend="gloo", group_name="raw", timeout_s=300
    )
    group = TransferGroup.join(rdv, host_store=True)
    buffer = torch.ones(total, dtype=torch.uint8)
    times = []
    for i in range(repeats + 1):  # first round warms up connections
        start = time.perf_counter()
        group.send_packed(buffer, bucket)
        elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
    for _ in procs:
        q.get(timeout=300)  # receivers finished the last bucket: the sender's time is the transfer's
    for p in procs:
        p.join(30)
    group.close()
    return statistics.median(times)


# -- end to end --------------------------------------------------------------------------------
def start_standin(log_dir: Path, broadcast: str, worker_id: str) -> ServiceProcess:
    port_file = log_dir / f"{worker_id}.port"
    log_path = log_dir / f"{worker_id}.log"
    cmd = [
        sys.executable,
        "-m",
        "services.broadcast.standin_receiver",
        "--broadcast_address",
        broadcast,
        "--worker_id",
        worker_id,
        "--port_file",
        str(port_file),
    ]
    with open(log_path, "ab") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return ServiceProcess(name=worker_id, proc=proc, port_file=port_file, log_path=log_path)


def end_to_end(
    stub, model: str, named: list, first_version: int, repeats: int, bucket: int
) -> list[dict[str, float]]:
    rounds = []
    tensors = [t for _, t in named]
    warmup = 2  # the service and receivers allocate their two buffers in the first two versions
    for i in range(repeats + warmup):
        version = first_version + i
        bump(named, version)
        start = time.perf_counter()
        metas = checksum.describe(named)
        described = time.perf_counter()
        request = pb.PublishVersionRequest(
            version=version,
            model=model,
            tensors=metas,
            checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
            bucket_bytes=bucket,
        )
        plan = stub.PublishVersion(request, timeout=30).plan
        group = TransferGroup.join(plan.rendezvous)
        sent = group.send(tensors, plan.bucket_bytes)
        group.close()
        trainer_done = time.perf_counter()
        reply = stub.WaitVersion(
            pb.WaitVersionRequest(version=version, state=pb.VERSION_STATE_DISTRIBUTED, timeout_s=600),
            timeout=620,
        )
        done = time.perf_counter()
        if not reply.reached:
            raise RuntimeError(f"v{version} not distributed: {reply}")
        status = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=10)
        behind = [w.worker_id for w in status.workers if w.weight_version != version]
        if behind:
            raise RuntimeError(f"v{version}: workers {behind} did not apply it: {status.workers}")
        row = {
            "checksum_s": described - start,
            "trainer_s": trainer_done - described,
            "e2e_s": done - described,
            "stall_s": max((w.last_paused_seconds for w in status.workers), default=0.0),
            "bytes": sent,
        }
        log(
            f"  v{version}: e2e {row['e2e_s']:.3f}s ({sent / row['e2e_s'] / 1e9:.2f} GB/s), trainer busy "
            f"{row['trainer_s']:.3f}s, stall {row['stall_s']:.3f}s, trainer checksums {row['checksum_s']:.3f}s"
            + (" (warm-up, not counted)" if i < warmup else "")
        )
        if i >= warmup:
            rounds.append(row)
    return rounds


def checksum_ms_per_100mb(named: list) -> float:
    total = sum(t.numel() * t.element_size() for _, t in named)
    checksum.describe(named[:1])
    start = time.perf_counter()
    checksum.describe(named)
    return (time.perf_counter() - start) * 1000 / (total / 1e8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=2, help="stand-in rollout workers")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per model (after warm-up)")
    parser.add_argument("--bucket_bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--large_mb", type=int, default=1024, help="random model size; 0 skips it")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    models = [("smollm2-135m", smollm2_weights)]
    if args.large_mb:
        models.append((f"random-{args.large_mb}mb", lambda: random_weights(args.large_mb)))
    log_dir = Path(tempfile.mkdtemp(prefix="parity-bench-sync-"))
    results = {}
    for model_name, loader in models:
        named = loader()
        total = Layout.of(
            [common_pb2.TensorMeta(shape=list(t.shape), dtype=checksum.dtype_name(t.dtype)) for _, t in named]
        ).total_bytes
        log(f"{model_name}: {len(named)} tensors, {total / 1e6:.1f} MB")
        ms = checksum_ms_per_100mb(named)
        log(f"{model_name}: WSUM64 checksum {ms:.1f} ms per 100 MB")
        log(f"{model_name}: raw gloo broadcast to {args.receivers} receivers ...")
        raw_s = raw_broadcast(total, args.receivers, args.bucket_bytes, args.repeats)
        log(f"{model_name}: raw {raw_s:.3f}s ({total / raw_s / 1e9:.2f} GB/s)")
        raw1_s = raw_broadcast(total, 1, args.bucket_bytes, args.repeats)
        log(f"{model_name}: raw to 1 receiver {raw1_s:.3f}s ({total / raw1_s / 1e9:.2f} GB/s)")

        broadcast = start_service(
            "broadcast",
            [
                "--transfer_timeout_s",
                "300",
                "--heartbeat_timeout_s",
                "60",
                "--bucket_bytes",
                str(args.bucket_bytes),
            ],
            log_dir=log_dir,
            name=f"broadcast-{model_name}",
        ).wait_ready(60)
        standins = [
            start_standin(log_dir, broadcast.address, f"{model_name}-w{i}") for i in range(args.receivers)
        ]
        try:
            for standin in standins:
                standin.wait_ready(120)
            with grpc.insecure_channel(broadcast.address) as chan:
                stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
                log(
                    f"{model_name}: end-to-end through the broadcast service to {args.receivers} receivers ..."
                )
                rounds = end_to_end(stub, model_name, named, 1, args.repeats, args.bucket_bytes)
        finally:
            for standin in standins:
                standin.stop(10)
            broadcast.stop(10)
        e2e = statistics.median(r["e2e_s"] for r in rounds)
        trainer = statistics.median(r["trainer_s"] for r in rounds)
        stall = statistics.median(r["stall_s"] for r in rounds)
        results[model_name] = {
            "bytes": total,
            "receivers": args.receivers,
            "raw_s": round(raw_s, 4),
            "raw_1_receiver_s": round(raw1_s, 4),
            "e2e_s": round(e2e, 4),
            "trainer_busy_s": round(trainer, 4),
            "stall_s": round(stall, 4),
            "raw_bytes_per_s": round(total / raw_s),
            "e2e_bytes_per_s": round(total / e2e),
            "e2e_over_raw": round(e2e / raw_s, 3),
            "trainer_over_raw": round(trainer / raw_s, 3),
            "checksum_ms_per_100mb": round(ms, 2),
        }
        log(
            f"{model_name}: e2e/raw = {e2e / raw_s:.2f} (goal <= 1.5), trainer busy/raw = {trainer / raw_s:.2f}, "
            f"stall {stall:.3f}s"
        )
        del named
    summary = {
        "benchmark": "weight_sync",
        "goal_e2e_over_raw": 1.5,
        "met": all(r["e2e_over_raw"] <= 1.5 for r in results.values()),
        "models": results,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
