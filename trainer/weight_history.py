"""The trainer's past weights: one host copy per published version, shared by every reader.

Two readers need the weights of versions the trainer has moved past:
- own-version rescoring and the PPO old policy (`old_logprobs=recompute`) load a version into a
  frozen copy of the model to score tokens under the weights that sampled them;
- the sender's catch-up hands the newest published version to a worker that joined late.
Both read this history, so a publish gathers the full weights once (one all-gather on several
ranks) and copies them to the host once.

Invariants:
- `record(v, named)` copies every tensor before returning (the optimizer may step right after);
  a recorded version is never modified, only dropped whole. Copies of GPU tensors are pinned
  (`host_copies`), so loading a version back onto the GPU runs at the bus's speed too.
- `keep` bounds the versions held (max_lag + 1 when a reader scores stale tokens, else 1); the newest
  is never dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_PINNED = True  # False once the host refused a pinned allocation (host_copies)

Bucket = list[tuple[str, Any, tuple[int, ...], Any]]  # (name, dtype, shape, tensor on the device)


def weight_buckets(model, bucket_bytes: int, announce: Callable[[], None] | None = None) -> Iterator[Bucket]:
    """Yield lists of (name, dtype, shape, tensor on the model's device) of about `bucket_bytes`
    each, in named_parameters order (tied weights once, as vLLM loads them). Sharded (DTensor)
    parameters are all-gathered on the device: a collective every rank must iterate; `announce`
    runs first (rank 0 of a multi-rank service tells the other ranks to gather with it)."""
    bucket: Bucket = []
    size = 0
    lm = model.lm if hasattr(model, "lm") and hasattr(model, "precision") else model
    if announce is not None and any(hasattr(p, "full_tensor") for p in lm.parameters()):
        announce()
    for name, param in lm.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        bucket.append((name, tensor.dtype, tuple(tensor.shape), tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def full_weights(model, bucket_bytes: int, announce: Callable[[], None] | None = None):
    """Every (name, full tensor on the device), contiguous: the gathered buckets, kept whole."""
    return [
        (name, tensor.contiguous())
        for bucket in weight_buckets(model, bucket_bytes, announce)
        for name, _dtype, _shape, tensor in bucket
    ]


class WeightHistory:
    """Host copies of published versions (see the module docstring). Thread-safe: the sender's
    catch-up thread reads while the training loop records."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.host_copies_total = 0  # tensors sets copied (one per recorded version)

    def record(self, version: int, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy `named` (on any device) to the host as `version`; drop the oldest beyond `keep`."""
        copied = host_copies(named)
        with self._lock:
            self._versions[version] = copied
            self.host_copies_total += 1
            for old in sorted(self._versions)[: max(0, len(self._versions) - self.keep)]:
                del self._versions[old]

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            return self._versions.get(version)

    def __contains__(self, version: int) -> bool:
        with self._lock:
            return version in self._versions

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def ordered(self, version: int, names: Sequence[str]) -> tuple[torch.Tensor, ...] | None:
        """`version`'s tensors in `names` order (a transfer plan's), or None when not held."""
        held = self.get(version)
        if held is None:
            return None
        return tuple(held[name] for name in names)


def host_copies(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """name -> a host copy of each tensor, complete when this returns. GPU tensors go into pinned
    host memory, all copies queued at once and waited for once: pinned copies run at the bus's
    speed and the next one need not wait for the last (a pageable copy is staged through a bounce
    buffer, one at a time). Pinned blocks return to torch's host-memory cache when a version is
    dropped and serve the next version's copies."""
    import torch

    global _PINNED
    copied: dict[str, torch.Tensor] = {}
    devices = set()
    for name, tensor in named:
        source = tensor.detach()
        host = None
        if source.is_cuda and _PINNED:
            try:
                host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            except RuntimeError as exc:  # the host refuses to pin this much: pageable from now on
                _PINNED = False
                log.warning(
                    "weight history: pinned host memory refused (%s); copying to pageable memory", exc
                )
        if host is not None:
            host.copy_(source, non_blocking=True)
            devices.add(source.device)
        else:
            host = source.to("cpu", copy=True)
        copied[name] = host
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return copied
