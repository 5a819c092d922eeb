"""One step under torch.profiler: where its time goes, by op and by trainer stage.

    wall_s, averages = profile_step(step, device)          # one call of `step`, profiled
    summary = write_profile(averages, wall_s, device, out_dir, "ours")
        # out_dir/ours_ops.txt: torch's table of the top ops; returns the same figures as a dict

On CUDA ops are ranked by their own device time (kernels), elsewhere by their own CPU time. The
trainer's stages (`train_step.<stage>` ranges, trainer/loop.py) are listed apart with their total
time, so one profiled step says both which stage and which kernels cost the most. Profiling slows
the step; its figures are for finding where the time goes, never for tokens/s.

`flops` is what the step executed, as torch.profiler counts it from the ops' shapes (`with_flops`):
matrix products (aten::mm, addmm, bmm) and element-wise add/mul, not attention kernels. It does not
depend on the machine, so a CPU run already says whether one side does more arithmetic than the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

STAGE_PREFIX = "train_step."
TOP_OPS = 30


def profile_step(step: Callable[[], None], device: torch.device) -> tuple[float, Any]:
    """(wall seconds of the profiled call, torch's key averages of its events)."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.device import synchronize

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities, with_flops=True) as prof:
        start = time.perf_counter()
        step()
        synchronize(device)
        wall_s = time.perf_counter() - start
    return wall_s, prof.key_averages()


def summarize(averages: Any, wall_s: float, on_device: bool) -> dict[str, Any]:
    """The step's wall time, its stages' total times and its top ops' own times, in ms."""
    own = "self_device_time_total" if on_device else "self_cpu_time_total"
    total = "device_time_total" if on_device else "cpu_time_total"
    stages = [e for e in averages if e.key.startswith(STAGE_PREFIX)]
    ops = sorted(
        (e for e in averages if not e.key.startswith(STAGE_PREFIX)),
        key=lambda e: getattr(e, own),
        reverse=True,
    )[:TOP_OPS]
    counted = {e.key: float(e.flops) for e in averages if getattr(e, "flops", 0)}
    return {
        "clock": "device" if on_device else "cpu",
        "wall_ms": round(wall_s * 1e3, 3),
        "flops": sum(counted.values()) if counted else None,
        "flops_by_op": dict(sorted(counted.items(), key=lambda item: -item[1])),
        "stages_ms": {
            e.key.removeprefix(STAGE_PREFIX): {
                "cpu": round(e.cpu_time_total / 1e3, 3),
                **({"device": round(e.device_time_total / 1e3, 3)} if on_device else {}),
            }
            for e in stages
        },
        "top_ops": [
            {
                "name": e.key,
                "self_ms": round(getattr(e, own) / 1e3, 3),
                "total_ms": round(getattr(e, total) / 1e3, 3),
                "calls": e.count,
            }
            for e in ops
        ],
    }


def write_profile(
    averages: Any, wall_s: float, device: torch.device, out_dir: Path, name: str
) -> dict[str, Any]:
    """`out_dir/<name>_ops.txt` (torch's table) and the summary of `summarize`."""
    on_device = device.type == "cuda"
    out_dir.mkdir(parents=True, exist_ok=True)
    sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
    (out_dir / f"{name}_ops.txt").write_text(averages.table(sort_by=sort_by, row_limit=TOP_OPS) + "\n")
    return summarize(averages, wall_s, on_device)
