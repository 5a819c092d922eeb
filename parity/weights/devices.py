"""Which GPU a rank is on, and whether a version fits where it would be received.

Invariants:
- A GPU is named by its UUID, never by its index: CUDA_VISIBLE_DEVICES may number one GPU
  differently in two processes. Two ranks with one UUID share a GPU (then CUDA IPC, not NCCL).
- A receive buffer is checked against free memory before it is allocated (`check_fits`): an
  oversized plan fails cleanly with TransferError instead of being OOM-killed mid-transfer.
"""

from __future__ import annotations

from parity.weights.layout import TransferError


def cuda_device_uuid(device: object = None) -> str:
    """The UUID of `device` (default: the current CUDA device): what NCCL calls a duplicate GPU, and
    what tells a trainer and a rollout worker that they share one (then CUDA IPC, not NCCL)."""
    import torch

    index = None if device is None else torch.device(device).index
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def local_cuda_index(device_uuid: str) -> int | None:
    """This process's index of the GPU whose UUID is `device_uuid` (None when it sees no such GPU:
    CUDA_VISIBLE_DEVICES may number one GPU differently in two processes)."""
    import torch

    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    return None


def available_bytes(device: str) -> int | None:
    """Free memory where a receive buffer would go (None when it cannot be measured). On a GPU: the
    named device's free memory. Not the allocator's unused cache: inside a vLLM engine that is the
    forward pass's activation pool, which a staging buffer would take from the next step."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(nbytes: int, device: str, headroom: float = 0.9) -> None:
    """TransferError unless `nbytes` fits in `headroom` of the free memory on `device` (checked
    before allocating: an oversized plan must fail cleanly, not be OOM-killed mid-transfer)."""
    free = available_bytes(device)
    if free is not None and nbytes > headroom * free:
        raise TransferError(
            f"plan: {nbytes} bytes do not fit in {device} memory ({free} bytes free, {headroom:.0%} usable)"
        )
