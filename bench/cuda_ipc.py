"""Same-GPU weight handoff: CUDA IPC (parity.weights.cuda_ipc) vs CUDA tensors over a gloo data group.

    python bench/cuda_ipc.py [--mb 1024 --tensors 64 --repeats 3]      # needs one CUDA GPU

A producer (this process, the trainer's role) holds `--mb` MiB of fp32 weights in `--tensors` CUDA
tensors; a consumer process (the rollout worker's role) on the same GPU gets them and ends holding
a verified copy in its own memory, by two paths, alternating round by round:
- ipc:  pack into one CUDA buffer, export an IPC handle (the CudaIpcHandle message over a pipe, never pickled); the
        consumer maps it, verifies every WSUM64 checksum on the device and copies it into its own
        weights (the swap);
- gloo: the same tensors broadcast over a held two-rank gloo group with CUDA tensors (what a
        non-colocated transfer does on one GPU: NCCL refuses two ranks on one device), received
        into the consumer's preallocated CUDA buffer, verified the same way.
Each path is timed on the producer's clock from the start of its work until the consumer reports
the verified copy. Reports the medians, their ratio gloo / ipc, and the consumer's map time per GiB.
The final stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import statistics
import sys
import time

SECRET = "bench-cuda-ipc-secret-0123456789"
BUCKET = 256 << 20


def _rendezvous(rank: int, port: int):
    from parity.v1 import common_pb2

    return common_pb2.Rendezvous(
        host="127.0.0.1", port=port, rank=rank, world_size=2, backend="gloo", group_name="bench-ipc",
        timeout_s=120, secret=SECRET,
    )  # fmt: skip


def _consumer(conn, port: int, metas_b64: list[str]) -> None:
    import torch

    from parity.v1 import common_pb2
    from parity.weights import checksum
    from parity.weights.cuda_ipc import import_buffer
    from parity.weights.layout import Layout, views
    from parity.weights.wire import TransferGroup

    metas = [common_pb2.TensorMeta.FromString(base64.b64decode(m)) for m in metas_b64]
    layout = Layout.of(metas)
    group = TransferGroup.join(_rendezvous(1, port))
    weights = torch.empty(layout.total_bytes, dtype=torch.uint8, device="cuda")
    landing = torch.empty(layout.total_bytes, dtype=torch.uint8, device="cuda")
    while True:
        command = json.loads(conn.recv_bytes())
        if command["op"] == "stop":
            group.close()
            return
        t0 = time.perf_counter()
        if command["op"] == "ipc":
            handle = common_pb2.CudaIpcHandle.FromString(base64.b64decode(command["handle"]))
            source = import_buffer(handle)
        else:
            source = group.recv_packed(metas, BUCKET, device="cuda", out=landing)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        bad = checksum.mismatched(metas, views(source, metas, layout))
        t2 = time.perf_counter()
        weights.copy_(source)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        del source
        conn.send_bytes(
            json.dumps({"get_s": t1 - t0, "verify_s": t2 - t1, "swap_s": t3 - t2, "bad": bad}).encode()
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench/cuda_ipc.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from parity.ports import free_port
    from parity.weights import checksum
    from parity.weights.cuda_ipc import export_buffer
    from parity.weights.layout import Layout, pack
    from parity.weights.wire import TransferGroup

    numel = args.mb * (1 << 20) // 4 // args.tensors
    gen = torch.Generator(device="cuda").manual_seed(0)
    named = [(f"w{i}", torch.randn(numel, generator=gen, device="cuda")) for i in range(args.tensors)]
    metas = checksum.describe(named)
    layout = Layout.of(metas)
    tensors = [t for _, t in named]
    print(
        f"{torch.cuda.get_device_name()}: {layout.total_bytes / 2**20:.0f} MiB in {args.tensors} tensors",
        flush=True,
    )
    port = free_port()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_consumer,
        args=(child, port, [base64.b64encode(m.SerializeToString()).decode() for m in metas]),
    )
    proc.start()
    group = TransferGroup.join(_rendezvous(0, port), host_store=True)

    def ask(command: dict) -> dict:
        parent.send_bytes(json.dumps(command).encode())
        if not parent.poll(300):
            raise TimeoutError(f"consumer gave no answer to {command['op']} in 300 s")
        reply = json.loads(parent.recv_bytes())
        if reply["bad"]:
            raise RuntimeError(f"{command['op']}: checksums mismatched for {reply['bad'][:5]}")
        return reply

    def via_ipc() -> dict:
        t0 = time.perf_counter()
        buffer = pack(tensors, layout, device="cuda")
        torch.cuda.synchronize()
        handle = base64.b64encode(export_buffer(buffer).SerializeToString()).decode()
        reply = ask({"op": "ipc", "handle": handle})
        reply["total_s"] = time.perf_counter() - t0
        del buffer
        return reply

    def via_gloo() -> dict:
        t0 = time.perf_counter()
        parent.send_bytes(json.dumps({"op": "gloo"}).encode())
        group.send(tensors, BUCKET)
        if not parent.poll(300):
            raise TimeoutError("consumer gave no answer to gloo in 300 s")
        reply = json.loads(parent.recv_bytes())
        if reply["bad"]:
            raise RuntimeError(f"gloo: checksums mismatched for {reply['bad'][:5]}")
        reply["total_s"] = time.perf_counter() - t0
        return reply

    rounds: dict[str, list[dict]] = {"ipc": [], "gloo": []}
    try:
        for r in range(args.repeats + 1):
            order = [("ipc", via_ipc), ("gloo", via_gloo)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                reply = fn()
                if r:
                    rounds[name].append(reply)
            label = "warmup" if r == 0 else f"round {r}/{args.repeats}"
            if r:
                print(
                    f"{label}: ipc {rounds['ipc'][-1]['total_s'] * 1e3:.1f} ms "
                    f"(map {rounds['ipc'][-1]['get_s'] * 1e3:.2f} ms), gloo {rounds['gloo'][-1]['total_s'] * 1e3:.1f} ms",
                    flush=True,
                )
            else:
                print(label + " done", flush=True)
        parent.send_bytes(json.dumps({"op": "stop"}).encode())
        proc.join(60)
    finally:
        group.close()
        if proc.is_alive():
            proc.kill()

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in rounds[name])

    gib = layout.total_bytes / 2**30
    result = {
        "device": torch.cuda.get_device_name(),
        "mib": round(layout.total_bytes / 2**20),
        "repeats": args.repeats,
        "ipc_total_ms": round(med("ipc", "total_s") * 1e3, 2),
        "ipc_map_ms_per_gib": round(med("ipc", "get_s") * 1e3 / gib, 3),
        "ipc_verify_ms": round(med("ipc", "verify_s") * 1e3, 2),
        "ipc_swap_ms": round(med("ipc", "swap_s") * 1e3, 2),
        "gloo_total_ms": round(med("gloo", "total_s") * 1e3, 2),
        "gloo_recv_ms": round(med("gloo", "get_s") * 1e3, 2),
        "gloo_over_ipc": round(med("gloo", "total_s") / med("ipc", "total_s"), 2),
        "ipc_total_ms_range": [round(min(x["total_s"] for x in rounds["ipc"]) * 1e3, 2),
                               round(max(x["total_s"] for x in rounds["ipc"]) * 1e3, 2)],
        "gloo_total_ms_range": [round(min(x["total_s"] for x in rounds["gloo"]) * 1e3, 2),
                                round(max(x["total_s"] for x in rounds["gloo"]) * 1e3, 2)],
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
