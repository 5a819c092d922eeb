"""Where the trainer computes: device selection, host->device transfer, peak FLOPs and memory.

Invariants:
- `trainer.device=auto` is CUDA when torch sees a GPU, else CPU; `cuda` without a GPU is a config
  error naming the field, never a silent fall-back to CPU.
- Under torchrun each process uses `cuda:$LOCAL_RANK` (one GPU per rank).
- Host tensors cross to the device once per micro-batch, from pinned memory on CUDA (the copy is
  asynchronous with respect to the host; the stream orders it before the kernels that read it).
- A figure the device cannot give is None (peak FLOPs of an unknown GPU or of a CPU), never 0.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING

from parity.config.base import ConfigError

if TYPE_CHECKING:
    import torch

# Dense (no sparsity) peak tensor throughput in FLOP/s, from the vendors' datasheets, by the
# substring torch.cuda.get_device_name reports. bf16 and tf32-off fp32 (CUDA-core) figures.
_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
}


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(kind: str) -> torch.device:
    """`auto | cpu | cuda` -> a torch.device (cuda:LOCAL_RANK for a CUDA run)."""
    import torch

    if kind not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device: must be auto, cpu or cuda (got {kind!r})")
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda requested but torch sees no CUDA device")
    rank = local_rank()
    if rank >= torch.cuda.device_count():
        raise ConfigError(
            f"trainer.device: LOCAL_RANK {rank} but only {torch.cuda.device_count()} CUDA devices"
        )
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host->device copy; pinned + non-blocking on CUDA, a no-op on CPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s for `precision` (bf16|fp32), or None when not known."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, figures in _PEAK_FLOPS.items():
        if key in name:
            return figures[precision]
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: bytes allocated at the peak since the last reset (torch's allocator).
    CPU: the process's peak resident set size since it started (the OS's figure)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
