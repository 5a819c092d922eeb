"""Moving a packed stream through a standalone torch.distributed group: one code path for gloo
(CPU) and NCCL (GPU).

The stream (`layout`) moves as consecutive buckets of at most `bucket_bytes` from rank 0 (the
trainer) to every other rank (rollout workers), never one op per tensor: on NCCL one `broadcast` per
bucket, on gloo a chain (rank 0 sends each bucket to rank 1, which forwards it to rank 2 as it
lands, ...; see `ALGORITHMS`).

Invariants:
- The sender is rank 0; receivers are ranks >= 1. A group is a standalone `ProcessGroup`, never the
  process-wide default group, so a process can hold several groups at once and lose one without
  affecting the others (`group.GroupHolder` keeps one per membership epoch).
- Every wait -- the join, each bucket -- fails after `Rendezvous.timeout_s` with TransferError;
  nothing hangs. A peer that dies mid-transfer raises on the other side (in a chain, on every rank
  downstream too), and a group that saw a failure is discarded, never reused.
- `recv_packed` receives into one freshly allocated buffer (or the caller's spare `out`): received
  bytes never touch tensors the caller is serving from (atomicity is the caller's swap).
"""

from __future__ import annotations

import datetime
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from parity.v1 import common_pb2
from parity.weights.layout import Layout, TransferError, layout_of_tensors, packed_in_place, views
from parity.weights.rendezvous import (
    DIGEST_BYTES,
    check_rendezvous,
    open_process_group,
    secret_proof,
    serve_store,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# How buckets move through a group. "broadcast": one collective per bucket (NCCL's broadcast is a
# pipelined ring). "chain": rank 0 sends each bucket to rank 1, which forwards it to rank 2 as soon as
# it has landed, and so on: gloo's broadcast has the root send every receiver its own copy, so the
# root's cores carry N copies; a chain carries one per link and pipelines them (gloo groups).
ALGORITHMS = ("broadcast", "chain")
_CHAIN_DEPTH_CUDA = 2  # chain over gloo with CUDA buffers: receives posted at once (pinned bounces)


def default_algorithm(backend: str) -> str:
    return "chain" if backend == "gloo" else "broadcast"


NCCL_RECEIVES_POSTED = 4  # buckets an NCCL receiver keeps posted (each one within timeout_s)


JOIN_MARGIN_S = 10.0  # over the rendezvous' timeout, for the store phase of a join


def _opened_within(rdv: common_pb2.Rendezvous, device_uuid: str, limit_s: float) -> object:
    """`open_process_group`, given up after `limit_s`. torch's store timeouts hold only while the
    store's server answers: against one that stopped answering (its host frozen or cut off) a
    store read blocks until TCP gives up, a quarter of an hour. The join runs on a thread of its
    own (with this thread's CUDA device); one that overran is left behind and its group, if it is
    ever made, is dropped."""
    import threading

    import torch

    device = (
        torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    done, outcome = threading.Event(), {}

    def open_it() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outcome["group"] = open_process_group(rdv, device_uuid)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=open_it, name=f"join-{rdv.group_name}", daemon=True).start()
    if not done.wait(limit_s):
        raise TransferError(
            f"join {rdv.group_name} as rank {rdv.rank}: the group's store at {rdv.host}:{rdv.port} did "
            f"not answer within {limit_s:.0f}s"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["group"]


class TransferGroup:
    """A standalone torch.distributed group for one transfer (see module docstring)."""

    def __init__(
        self,
        process_group: object,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        algorithm: str = "",
    ):
        self._pg = process_group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.algorithm = algorithm or default_algorithm(backend)
        if self.algorithm not in ALGORITHMS:
            raise TransferError(f"algorithm: {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        self._tag = 0  # chain: every rank numbers the buckets it posts identically
        self._ring: list[torch.Tensor] = []  # chain with CUDA buffers: pinned host bounce buffers

    @classmethod
    def join(
        cls,
        rendezvous: common_pb2.Rendezvous,
        host_store: bool = False,
        device_uuid: str = "",
        algorithm: str = "",
    ) -> TransferGroup:
        """Join the group named by `rendezvous`; blocks until every rank has joined or timeout_s.

        `device_uuid`: this rank's device identity for the shared-GPU check (NCCL groups always run
        it with the current CUDA device; a gloo group runs it only when one is given). `algorithm`:
        how buckets move (`ALGORITHMS`; default by backend), the same on every rank."""
        rdv = rendezvous
        check_rendezvous(rdv)
        if rdv.world_size < 2:
            raise TransferError(f"rendezvous.world_size: a group needs a receiver (got {rdv.world_size})")
        if host_store:
            serve_store(rdv.host, rdv.port, float(rdv.timeout_s))
        pg = None
        try:
            pg = _opened_within(rdv, device_uuid, float(rdv.timeout_s) + JOIN_MARGIN_S)
            group = cls(pg, rdv.rank, rdv.world_size, rdv.backend, float(rdv.timeout_s), algorithm)
            group._prove_secret(rdv)  # also makes a lazily connecting NCCL fail fast, like gloo
        except TransferError:
            if pg is not None:
                cls(pg, rdv.rank, rdv.world_size, rdv.backend, 1.0).close()
            raise
        except Exception as exc:  # translate: timeouts and connect errors look alike to callers
            if pg is not None:
                cls(pg, rdv.rank, rdv.world_size, rdv.backend, 1.0).close()
            raise TransferError(f"join {rdv.group_name} as rank {rdv.rank}: {exc}") from exc
        return group

    def _prove_secret(self, rdv: common_pb2.Rendezvous) -> None:
        """All-gather every rank's proof of the secret; fail unless every peer's is right."""
        import torch

        device = "cuda" if self.backend == "nccl" else "cpu"
        mine = torch.frombuffer(
            bytearray(secret_proof(rdv.secret, rdv.group_name, self.rank)), dtype=torch.uint8
        )
        outputs = [
            torch.zeros(DIGEST_BYTES, dtype=torch.uint8, device=device) for _ in range(self.world_size)
        ]
        work = self._pg.allgather([outputs], [mine.to(device)])  # type: ignore[attr-defined]
        self._wait(work, DIGEST_BYTES * self.world_size)
        for rank, proof in enumerate(outputs):
            expected = secret_proof(rdv.secret, rdv.group_name, rank)
            if not hmac.compare_digest(bytes(proof.cpu().tolist()), expected):
                self.close()
                raise TransferError(f"join {rdv.group_name}: rank {rank} did not prove the group's secret")

    # -- primitives -----------------------------------------------------------------------------
    def _issue(self, buffer: torch.Tensor) -> object:
        """Broadcast `buffer` from rank 0 (every rank calls it with its own buffer)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            return self._pg.broadcast([buffer], opts)
        except Exception as exc:
            raise TransferError(f"broadcast of {buffer.numel()} bytes failed: {exc}") from exc

    def _p2p(self, op: str, buffer: torch.Tensor, peer: int, tag: int) -> object:
        """Post a gloo send or recv of a host buffer to or from `peer` (chain)."""
        try:
            return getattr(self._pg, op)([buffer], peer, tag)
        except Exception as exc:
            raise TransferError(f"{op} of {buffer.numel()} bytes with rank {peer} failed: {exc}") from exc

    def _next_tag(self) -> int:
        tag, self._tag = self._tag, (self._tag + 1) % (2**31)
        return tag

    def _wait(self, work: object, nbytes: int) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise TransferError(f"{self.algorithm} of {nbytes} bytes failed: {exc}") from exc

    def _bounce(self, slots: int, nbytes: int) -> list[torch.Tensor]:
        """Pinned host buffers for CUDA buckets on a gloo chain (gloo's point-to-point ops read and
        write host memory only), allocated once per group and kept while big enough."""
        import torch

        if len(self._ring) < slots or self._ring[0].numel() < nbytes:
            self._ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        return self._ring

    def _post_send(self, bucket: torch.Tensor, index: int, bucket_bytes: int) -> tuple[object, int]:
        """Rank 0: put bucket `index` on the wire; returns (work, bytes). The caller keeps at most two
        in flight, so a CUDA bucket's bounce slot (index mod 3) is free again."""
        import torch

        if self.algorithm == "broadcast":
            return self._issue(bucket), bucket.numel()
        host = bucket
        if bucket.is_cuda:
            host = self._bounce(3, bucket_bytes)[index % 3][: bucket.numel()]
            host.copy_(bucket, non_blocking=True)
            torch.cuda.current_stream(bucket.device).synchronize()
        return self._p2p("send", host, 1, self._next_tag()), bucket.numel()

    # -- sender ---------------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> int:
        """Rank 0: send `tensors` (packed, bucketed) to every other rank; returns bytes sent.

        Double-buffered: bucket i+1 is packed while bucket i is on the wire. A bucket that lies
        inside one tensor is sent as a view of it, with no packing copy (on a CPU host every copy
        competes with the transfer for the same cores)."""
        import torch

        if self.rank != 0:
            raise TransferError(f"send: only rank 0 sends (this is rank {self.rank})")
        layout = layout_of_tensors(tensors)
        if not tensors:
            return 0
        device = tensors[0].device
        if self.backend == "nccl" and device.type != "cuda":
            # NCCL moves GPU memory only: host tensors (a catch-up's snapshot, the weight history's
            # pinned copies) go through this GPU bucket by bucket, never the whole model at once.
            device = torch.device("cuda", torch.cuda.current_device())
        in_place = packed_in_place(tensors, layout)
        if in_place is not None and in_place.device == device:  # one packed stream already: no copy
            if in_place.device.type == "cuda":
                torch.cuda.current_stream(in_place.device).synchronize()
            return self.send_packed(in_place, bucket_bytes)
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        size = min(bucket_bytes, layout.total_bytes)
        staging = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
        pending: tuple[object, int] | None = None
        for i, (start, end) in enumerate(layout.buckets(bucket_bytes)):
            bucket = staging[i % 2][: end - start]  # its last user (bucket i-2) has completed
            for flat, offset, nbytes in zip(flats, layout.offsets, layout.nbytes, strict=True):
                lo, hi = max(start, offset), min(end, offset + nbytes)
                if lo == start and hi == end and flat.device == device:  # the bucket lies in this tensor
                    bucket = flat[lo - offset : hi - offset]
                    break
                if lo < hi:
                    bucket[lo - start : hi - start] = flat[lo - offset : hi - offset]
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            if pending is not None:
                self._wait(*pending)
            pending = self._post_send(bucket, i, size)
        if pending is not None:
            self._wait(*pending)
        return layout.total_bytes

    def send_packed(
        self,
        buffer: torch.Tensor,
        bucket_bytes: int,
        ready: Callable[[int], None] | None = None,
    ) -> int:
        """Rank 0: send an already packed uint8 buffer. `ready(end)` blocks until bytes [0, end)
        are valid. A broadcast keeps one bucket in flight (on a CPU-bound host two measured slower);
        a chain keeps two, so that rank 1 always has the next bucket coming while it forwards."""
        if self.rank != 0:
            raise TransferError(f"send: only rank 0 sends (this is rank {self.rank})")
        layout = Layout((0,), (buffer.numel(),), buffer.numel())
        depth = 2 if self.algorithm == "chain" else 1
        pending: list[tuple[object, int]] = []
        for i, (start, end) in enumerate(layout.buckets(bucket_bytes)):
            if ready is not None:
                ready(end)
            if len(pending) >= depth:
                self._wait(*pending.pop(0))
            pending.append(self._post_send(buffer[start:end], i, min(bucket_bytes, buffer.numel())))
        for work in pending:
            self._wait(*work)
        return buffer.numel()

    # -- receiver -------------------------------------------------------------------------------
    def recv_packed(
        self,
        metas: Sequence[common_pb2.TensorMeta],
        bucket_bytes: int,
        device: str = "cpu",
        progress: Callable[[int], None] | None = None,
        out: torch.Tensor | None = None,
        ahead: int = 0,
    ) -> torch.Tensor:
        """Ranks >= 1: receive the packed stream into a new uint8 buffer (or `out`); `progress(end)`
        is called once bytes [0, end) have arrived (e.g. to checksum what has landed, so that
        verification does not all wait for the last bucket). Every bucket's receive is posted at
        once (`ahead=0`: they are disjoint views of one buffer, so this costs no memory), and the
        wire never waits on `progress`; `ahead=n` keeps at most n posted (a receiver that models a
        slow link). NCCL keeps NCCL_RECEIVES_POSTED posted unless `ahead` says otherwise."""
        import torch

        if self.rank == 0:
            raise TransferError("recv: rank 0 is the sender")
        layout = Layout.of(metas)
        buffer = out if out is not None else torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        if buffer.numel() != layout.total_bytes:
            raise TransferError(f"out: {buffer.numel()} bytes, the plan needs {layout.total_bytes}")
        buckets = layout.buckets(bucket_bytes)
        if self.algorithm == "chain":
            return self._recv_chain(buffer, buckets, progress, ahead)
        if ahead <= 0:
            # gloo: every receive at once. NCCL's watchdog times a work from when it is posted, so
            # posting a whole model's buckets would give the whole transfer one timeout_s: a few.
            ahead = NCCL_RECEIVES_POSTED if self.backend == "nccl" else len(buckets)
        depth = ahead
        posted: list[tuple[object, int, int]] = []
        for start, end in buckets[:depth]:
            posted.append((self._issue(buffer[start:end]), end - start, end))
        for i in range(len(buckets)):
            work, nbytes, end = posted[i]
            self._wait(work, nbytes)
            if i + depth < len(buckets):
                start, stop = buckets[i + depth]
                posted.append((self._issue(buffer[start:stop]), stop - start, stop))
            if progress is not None:
                progress(end)
        return buffer

    def _recv_chain(
        self,
        buffer: torch.Tensor,
        buckets: list[tuple[int, int]],
        progress: Callable[[int], None] | None,
        ahead: int,
    ) -> torch.Tensor:
        """Receive each bucket from the previous rank and forward it to the next one as soon as it
        has landed (before `progress` runs on it). A forward that fails fails this receive too: the
        group is broken, and every rank's transfer of this version fails with it."""
        import torch

        cuda = buffer.is_cuda
        depth = len(buckets) if ahead <= 0 else ahead
        if cuda:  # gloo reads and writes host memory only: bounce through pinned host buffers
            depth = min(depth, _CHAIN_DEPTH_CUDA)
            ring = self._bounce(2 * depth, max(end - start for start, end in buckets))
        forward = self.rank + 1 < self.world_size
        posted: list[tuple[object, torch.Tensor, int, int]] = []
        sends: dict[int, tuple[object, int]] = {}

        def post(i: int) -> None:
            start, end = buckets[i]
            if cuda:  # slot i mod 2*depth: its last bucket (i - 2*depth) was copied out; its forward
                if (sent := sends.pop(i - 2 * depth, None)) is not None:  # must be done too
                    self._wait(*sent)
                target = ring[i % (2 * depth)][: end - start]
            else:
                target = buffer[start:end]
            tag = self._next_tag()  # the sender numbered its buckets the same way
            posted.append((self._p2p("recv", target, self.rank - 1, tag), target, end, tag))

        for i in range(min(depth, len(buckets))):
            post(i)
        for i, (start, _) in enumerate(buckets):
            work, landed, end, tag = posted[i]
            self._wait(work, landed.numel())
            if forward:
                sends[i] = (self._p2p("send", landed, self.rank + 1, tag), landed.numel())
            if cuda:
                buffer[start:end].copy_(landed, non_blocking=True)
                torch.cuda.current_stream(buffer.device).synchronize()
            if i + depth < len(buckets):
                post(i + depth)
            if progress is not None:
                progress(end)
        for work in sends.values():
            self._wait(*work)
        return buffer

    def recv(
        self, metas: Sequence[common_pb2.TensorMeta], bucket_bytes: int, device: str = "cpu"
    ) -> list[torch.Tensor]:
        """Ranks >= 1: receive every tensor of `metas`; returns new tensors in meta order."""
        buffer = self.recv_packed(metas, bucket_bytes, device)
        return views(buffer, metas, Layout.of(metas))

    def close(self) -> None:
        """Release the group's connections (safe to call twice)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            if self.backend == "nccl":
                pg.abort()
            else:
                pg.shutdown()
        except Exception as exc:  # the group is discarded either way; a failed teardown is only logged
            log.warning(
                "closing %s group (rank %s): %s: %s", self.backend, self.rank, type(exc).__name__, exc
            )
