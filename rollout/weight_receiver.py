"""Receive one weight version over torch.distributed into staging tensors, and verify it.

Shared by the vLLM worker extension (runs inside vLLM's worker process) and the reference engine
(runs in the service process). Nothing here touches the serving weights: the caller swaps the
staged tensors in only when `StagedWeights.error` is empty, so a failed or corrupted transfer
leaves the old weights serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class StagedWeights:
    """Tensors in plan order with the receiver's own checksums; `error` names what went wrong."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    error: str = ""
    transfer_s: float = 0.0
    verify_s: float = 0.0

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.tensors, strict=True))

    def report(self) -> dict:
        """Plain data for collective_rpc replies (no tensors cross the process boundary)."""
        return {
            "error": self.error,
            "checksums": [int(c) for c in self.checksums],
            "transfer_s": self.transfer_s,
            "verify_s": self.verify_s,
        }


def receive_and_verify(plan, device: str = "cpu", fault_corrupt_tensor: str = "") -> StagedWeights:
    """Join `plan.rendezvous`, receive every tensor, verify checksums. Never raises on a bad transfer."""
    from parity import checksum
    from parity.transport import TransferGroup

    staged = StagedWeights(names=[meta.name for meta in plan.tensors])
    start = time.perf_counter()
    group = None
    try:
        group = TransferGroup.join(plan.rendezvous)
        staged.tensors = group.recv(list(plan.tensors), int(plan.bucket_bytes), device=device)
    except Exception as exc:  # a transfer failure must leave the old weights serving
        staged.error = f"transfer of version {plan.version} failed: {type(exc).__name__}: {exc}"
        staged.tensors = []
        return staged
    finally:
        if group is not None:
            group.close()  # best effort by design; never raises
        staged.transfer_s = time.perf_counter() - start
    if fault_corrupt_tensor:
        if fault_corrupt_tensor not in staged.names:
            staged.error = f"fault_corrupt_tensor: {fault_corrupt_tensor!r} is not in the plan"
            return staged
        victim = staged.tensors[staged.names.index(fault_corrupt_tensor)]
        victim.view(-1)[0] += 1.0
    start = time.perf_counter()
    staged.checksums = [checksum.tensor_checksum(t) for t in staged.tensors]
    bad = checksum.mismatched(list(plan.tensors), staged.tensors)
    staged.verify_s = time.perf_counter() - start
    if bad:
        staged.error = f"checksum mismatch in version {plan.version} for tensor(s): {', '.join(bad)}"
    return staged
