"""A whole weight update on one GPU through the services: CUDA IPC vs the gloo data group.

    python bench/ipc_update.py [--mb 1024 --tensors 64 --repeats 3]      # needs one CUDA GPU

This process is the trainer (`parity.weights.sender.Publisher`, weights in `--tensors` CUDA tensors of
`--mb` MiB in all). Two broadcast services run side by side, each with one stand-in rollout worker
(tests/fakes/fake_receiver.py, the real receiver without an engine) receiving onto this GPU:
- ipc:  the worker registers its GPU, so the service keeps it out of the data group and the trainer
        offers one packed buffer by CUDA IPC (OfferIpcBuffer); the worker maps, copies, verifies;
- gloo: the same worker registered without its GPU (`--hide_device`): it is a rank of the gloo group,
        and the bytes are broadcast through host memory (the only group path on one GPU: NCCL
        refuses two ranks on one device).
Each round publishes the same new version to both, alternating which goes first, and times
`publish_tensors` end to end (PublishVersion -> transfer -> verify -> swap -> every ack). Reports the
medians, their ranges and the ratio gloo / ipc. The final stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weight_sync import start_broadcast, start_standin


def log(message: str) -> None:
    print(f"[ipc_update {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="MiB of fp32 weights")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds (after one warm-up)")
    args = parser.parse_args(argv)

    import torch

    from parity.weights.layout import DEFAULT_BUCKET_BYTES
    from parity.weights.sender import Publisher

    if not torch.cuda.is_available():
        print("bench/ipc_update.py needs a CUDA GPU", file=sys.stderr)
        return 2
    numel = args.mb * (1 << 20) // 4 // args.tensors
    log_dir = Path(tempfile.mkdtemp(prefix="bench-ipc-update-"))
    services, publishers = [], {}
    try:
        for path, extra in (("ipc", ()), ("gloo", ("--hide_device",))):
            broadcast = start_broadcast(log_dir, f"broadcast-{path}", DEFAULT_BUCKET_BYTES)
            worker = start_standin(log_dir, broadcast.address, f"{path}-w", "--device", "cuda", *extra)
            services += [broadcast, worker]
            worker.wait_ready(120)
            publishers[path] = Publisher(
                broadcast.address, "bench", wait_committed_s=600, keep_snapshot=False
            )
        times: dict[str, list[float]] = {"ipc": [], "gloo": []}
        for version in range(1, args.repeats + 2):
            gen = torch.Generator(device="cuda").manual_seed(version)
            named = [(f"t{i}", torch.randn(numel, generator=gen, device="cuda")) for i in range(args.tensors)]
            torch.cuda.synchronize()
            order = ("ipc", "gloo") if version % 2 else ("gloo", "ipc")
            for path in order:
                start = time.perf_counter()
                result = publishers[path].publish_tensors(named, version)
                seconds = time.perf_counter() - start
                if not result.committed:
                    raise RuntimeError(f"{path}: version {version} did not commit")
                if version > 1:
                    times[path].append(seconds)
                log(
                    f"v{version} {path}: {seconds * 1000:.1f} ms end to end"
                    + (" (warm-up)" if version == 1 else "")
                )
        medians = {path: statistics.median(values) for path, values in times.items()}
        report = {
            "device": torch.cuda.get_device_name(),
            "mib": args.mb,
            "tensors": args.tensors,
            "repeats": args.repeats,
            "ipc_update_ms": round(medians["ipc"] * 1000, 1),
            "gloo_update_ms": round(medians["gloo"] * 1000, 1),
            "ipc_update_ms_range": [round(min(times["ipc"]) * 1000, 1), round(max(times["ipc"]) * 1000, 1)],
            "gloo_update_ms_range": [
                round(min(times["gloo"]) * 1000, 1),
                round(max(times["gloo"]) * 1000, 1),
            ],
            "gloo_over_ipc": round(medians["gloo"] / medians["ipc"], 2),
        }
        log(
            f"ipc {report['ipc_update_ms']} ms vs gloo {report['gloo_update_ms']} ms: {report['gloo_over_ipc']}x"
        )
        print(json.dumps(report))
        return 0
    finally:
        for publisher in publishers.values():
            publisher.close()
        for service in reversed(services):
            service.stop(10)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
