"""Receive one weight version over the epoch's data group into staging tensors, and verify it.

Shared by the vLLM worker extension (runs inside vLLM's worker process), the reference engine (runs
in the service process) and the tests' stand-in receiver. Nothing here touches the serving weights:
the caller swaps the staged tensors in only when `StagedWeights.error` is empty, so a failed or
corrupted transfer leaves the old weights serving.

A worker on the trainer's own GPU gets a plan with `cuda_ipc` instead of a rendezvous: it maps the
trainer's packed buffer (`map_and_verify`), never joins a group. The group is held across versions
(`group.GroupHolder`: one join per membership epoch), the plan's size is checked against free
memory before anything is allocated, and each tensor is checksummed as its bytes arrive (each
bucket's share, in host memory), while the next buckets are on the wire.

In a chain, every receiver forwards the bytes as they arrived and verifies its own copy. A byte
corrupted on the wire into receiver k reaches every receiver after it, and each of them fails the
version on its own checksums and keeps its old weights; a fault in receiver k's own copy (what
`fault_corrupt_tensor` injects) fails receiver k alone. The broadcast service then marks the
version DISTRIBUTED for the receivers that verified it and brings the others up to date.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parity.weights.devices import check_fits, local_cuda_index
from parity.weights.group import GroupHolder
from parity.weights.layout import Layout, TransferError
from parity.weights.rendezvous import ONE_SHOT_PREFIX, group_store, rendezvous_problem
from parity.weights.verify import StreamVerifier

if TYPE_CHECKING:
    import torch

_holder: GroupHolder | None = None


def process_holder() -> GroupHolder:
    """This process's epoch group (one receiver per process: a vLLM worker, or a service)."""
    global _holder
    if _holder is None:
        _holder = GroupHolder()
    return _holder


@dataclass
class StagedWeights:
    """Tensors in plan order with the receiver's own checksums; `error` names what went wrong."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    error: str = ""
    transfer_s: float = 0.0
    verify_s: float = 0.0
    buffer: torch.Tensor | None = None  # the packed bytes `tensors` view

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


def receive_and_verify(
    plan,
    device: str = "cpu",
    fault_corrupt_tensor: str = "",
    holder: GroupHolder | None = None,
    out: torch.Tensor | None = None,
    on_bucket: Callable[[int], None] | None = None,
    ahead: int = 0,
) -> StagedWeights:
    """Receive every tensor of `plan` through its group and verify checksums. Never raises on a bad
    transfer. `holder` keeps the epoch's group between versions (default: this process's holder;
    every rank of an epoch holds its group, so a receiver may not close it on its own); `out` is a
    spare packed buffer of the right size to receive into (else one is allocated); `on_bucket(end)`
    runs after each bucket and `ahead` caps the receives posted at once (0: every bucket; tests slow a
    receiver down with both, as a slow link would)."""
    import torch

    if plan.HasField("cuda_ipc"):
        return map_and_verify(plan, fault_corrupt_tensor, out)
    metas = list(plan.tensors)
    staged = StagedWeights(names=[meta.name for meta in metas])
    start = time.perf_counter()
    holder = holder or process_holder()
    try:
        layout = Layout.of(metas)
        if fault_corrupt_tensor and fault_corrupt_tensor not in staged.names:
            raise TransferError(f"fault_corrupt_tensor: {fault_corrupt_tensor!r} is not in the plan")
        if out is None or out.numel() != layout.total_bytes or out.device.type != device.split(":")[0]:
            check_fits(layout.total_bytes, device)
            out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        verifier = StreamVerifier(out, metas)
        corrupt_at = layout.offsets[staged.names.index(fault_corrupt_tensor)] if fault_corrupt_tensor else -1

        def progress(end: int) -> None:
            verifier.advance(end)
            if on_bucket is not None:
                on_bucket(end)

        with holder.use(plan.rendezvous) as group:
            group.recv_packed(metas, int(plan.bucket_bytes), out=out, progress=progress, ahead=ahead)
        if corrupt_at >= 0:
            _corrupt_own_copy(out, verifier, staged.names.index(fault_corrupt_tensor), corrupt_at)
    except Exception as exc:  # a transfer failure must leave the old weights serving
        return _failed(staged, f"transfer of version {plan.version}", exc, start)
    return _verified(staged, plan, out, verifier, start)  # the tail: tensors finished by the last bucket


def _corrupt_own_copy(out: torch.Tensor, verifier, index: int, offset: int) -> None:
    """Fault injection: flip one byte of this receiver's copy, as a bad local copy would, after
    every bucket was forwarded (recv_packed waits for its forwards), so the fault stays here: the
    receivers after this one in the chain get the bytes as they arrived. The tensor's checksum is
    taken again over the flipped copy."""
    from parity.weights.checksum import tensor_checksum

    out[offset] ^= 0xFF
    verifier.advance(verifier.layout.total_bytes)
    verifier.checksums[index] = tensor_checksum(verifier.tensors[index])


def _failed(staged: StagedWeights, what: str, exc: Exception, start: float) -> StagedWeights:
    staged.error = f"{what} failed: {type(exc).__name__}: {exc}"
    staged.transfer_s = time.perf_counter() - start
    return staged


def _verified(staged: StagedWeights, plan, out: torch.Tensor, verifier, start: float) -> StagedWeights:
    """Finish the checksums (those not done while receiving), keep the received buffer and views."""
    received = time.perf_counter()
    staged.transfer_s = received - start
    bad = verifier.mismatched()
    staged.buffer, staged.tensors, staged.checksums = out, verifier.tensors, verifier.checksums
    staged.verify_s = time.perf_counter() - received
    if bad:
        staged.error = f"checksum mismatch in version {plan.version} for tensor(s): {', '.join(bad)}"
    return staged


def map_and_verify(plan, fault_corrupt_tensor: str = "", out: torch.Tensor | None = None) -> StagedWeights:
    """`receive_and_verify` for a worker on the trainer's GPU: map the trainer's packed buffer by CUDA
    IPC (`plan.cuda_ipc`), copy it into this worker's own buffer (device to device: the trainer frees
    its buffer once the version settles) and verify that copy. Never raises on a bad handoff."""
    import torch

    from parity.weights.cuda_ipc import import_buffer

    metas = list(plan.tensors)
    staged = StagedWeights(names=[meta.name for meta in metas])
    start = time.perf_counter()
    handle = plan.cuda_ipc
    try:
        layout = Layout.of(metas)
        if handle.nbytes != layout.total_bytes:
            raise TransferError(
                f"cuda_ipc.nbytes: {handle.nbytes}, the plan packs {layout.total_bytes} bytes"
            )
        if fault_corrupt_tensor and fault_corrupt_tensor not in staged.names:
            raise TransferError(f"fault_corrupt_tensor: {fault_corrupt_tensor!r} is not in the plan")
        index = local_cuda_index(handle.device_uuid)
        if index is None:
            raise TransferError(f"cuda_ipc.device_uuid: this process sees no GPU {handle.device_uuid}")
        device = torch.device("cuda", index)
        if out is None or out.numel() != layout.total_bytes or out.device != device:
            check_fits(layout.total_bytes, str(device))
            out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        source = import_buffer(handle, device_index=index)
        with torch.cuda.device(index):
            out.copy_(source)
            torch.cuda.synchronize()
        del source
        if fault_corrupt_tensor:  # flip one byte, as a bad copy would
            out[layout.offsets[staged.names.index(fault_corrupt_tensor)]] ^= 0xFF
    except Exception as exc:  # a failed handoff must leave the old weights serving
        return _failed(staged, f"CUDA IPC handoff of version {plan.version}", exc, start)
    return _verified(staged, plan, out, StreamVerifier(out, metas), start)


_ready_groups: set[str] = set()  # epoch groups this process's worker already joined (held there)


def forget_ready_groups() -> None:
    """The worker that held this process's epoch group is gone (its engine restarted): the next
    plan's group must be rendezvoused again."""
    _ready_groups.clear()


def rendezvous_ready(rdv) -> str:
    """Blocking, in the service process: make sure every rank of `rdv`'s group has come to the store
    before the worker is asked to join, so that a dead rendezvous fails here, outside the engine
    (a vLLM worker joins inside a collective_rpc, which the engine core serves between steps: a
    rendezvous that never completes would stall generation for its whole timeout). Marks this rank
    as arriving, waits for the others (timeout_s); "" when all came, else the error. An epoch group
    the worker already holds needs no rendezvous."""
    import datetime

    if rdv.group_name in _ready_groups:
        return ""
    problem = rendezvous_problem(rdv)
    if problem is not None:
        return f"rendezvous.{problem[0]}: {problem[1]}"
    timeout = datetime.timedelta(seconds=float(rdv.timeout_s))
    try:
        store = group_store(rdv)
        store.set(f"joined/{rdv.rank}", "1")
        store.wait([f"joined/{r}" for r in range(rdv.world_size)], timeout)
    except Exception as exc:  # a timeout or an unreachable store: nothing was joined, nothing paused
        return f"rendezvous {rdv.group_name}: not every rank arrived within {rdv.timeout_s:g}s ({exc})"
    if not rdv.group_name.startswith(ONE_SHOT_PREFIX):
        _ready_groups.clear()  # one epoch group is held at a time
        _ready_groups.add(rdv.group_name)
    return ""
