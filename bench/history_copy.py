"""The weight history's copies on a GPU: pinned (ours) against pageable host memory.

    python bench/history_copy.py [--device cuda] [--mb 6144 --tensors 340 --repeats 3]

Each publish records the full weights in the trainer's history (trainer/weight_history.py), and
each own-version rescoring loads a past version back into the frozen copy on the GPU. "ours" is
`host_copies` (pinned host memory, every copy queued, one wait) and, back, `copy_(non_blocking=True)`
from it; "pageable" is `tensor.to("cpu", copy=True)` per tensor and a plain `copy_` back. The
default size is a 1.5B-parameter model in float32 (6 GiB in 340 tensors). Rounds alternate which
side goes first; the first round of each side is a warm-up (pinned blocks allocated). Prints one
line per round and a JSON object last: seconds (median), GB/s, and `ratio` (pageable ÷ ours, > 1:
ours is faster). On a CPU both sides are plain copies (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--mb", type=int, default=6144, help="total size of the weights, MiB")
    parser.add_argument("--tensors", type=int, default=340)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from trainer.weight_history import host_copies

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    numel = args.mb * 2**20 // 4 // args.tensors
    named = [(f"w{i}", torch.randn(numel, device=device)) for i in range(args.tensors)]
    total_gb = numel * 4 * args.tensors / 1e9

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def pageable_record():
        return {name: t.detach().to("cpu", copy=True) for name, t in named}

    def load(held, non_blocking: bool) -> None:
        for name, target in named:
            target.copy_(held[name], non_blocking=non_blocking)
        sync()

    sides = {
        "ours": (lambda: host_copies(named), True),
        "pageable": (pageable_record, False),
    }
    times: dict[str, dict[str, list[float]]] = {name: {"record": [], "load": []} for name in sides}
    for round_index in range(args.repeats + 1):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        line = []
        for name in order:
            record, non_blocking = sides[name]
            sync()
            start = time.perf_counter()
            held = record()
            recorded = time.perf_counter() - start
            start = time.perf_counter()
            load(held, non_blocking)
            loaded = time.perf_counter() - start
            del held
            if round_index > 0:
                times[name]["record"].append(recorded)
                times[name]["load"].append(loaded)
            line.append(f"{name} record {recorded:.3f}s load {loaded:.3f}s")
        label = "warmup" if round_index == 0 else f"round {round_index}/{args.repeats}"
        print(f"{label}: " + ", ".join(line), flush=True)
    summary: dict = {"bench": "history_copy", "device": args.device, "gb": round(total_gb, 3)}
    for name in sides:
        for phase in ("record", "load"):
            seconds = statistics.median(times[name][phase])
            summary[f"{name}_{phase}_s"] = round(seconds, 4)
            summary[f"{name}_{phase}_gb_per_s"] = round(total_gb / seconds, 2) if seconds > 0 else None
    for phase in ("record", "load"):
        ours, pageable = summary[f"ours_{phase}_s"], summary[f"pageable_{phase}_s"]
        summary[f"{phase}_ratio"] = round(pageable / ours, 3) if ours > 0 else None
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
