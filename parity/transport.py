"""Tensor transport over torch.distributed: one code path for gloo (CPU) and NCCL (GPU).

A transfer is a byte stream. Tensors are laid out back to back (each start aligned to `ALIGN_BYTES`)
in one packed stream of `total_bytes`, and the stream moves as consecutive buckets of at most
`bucket_bytes`, one `broadcast` per bucket from rank 0 to every other rank: never one collective per
tensor. Both sides derive the identical layout from the metadata alone.

Invariants:
- The sender is rank 0; receivers are ranks >= 1. The broadcast service always hosts the TCPStore;
  each group lives under its own store prefix (`Rendezvous.group_name`), so many groups share one
  store port.
- Groups are standalone `ProcessGroup` objects, never the process-wide default group, so one process
  (the broadcast service) can hold several groups at once and lose one without affecting the others.
- Every wait -- rendezvous, connect, each bucket -- fails after `Rendezvous.timeout_s` with an
  exception; nothing hangs. A peer that dies mid-transfer raises on the other side.
- `recv` returns views into one freshly allocated buffer: received bytes never touch tensors the
  caller is serving from (atomicity is the caller's swap).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The bucket default lives with the config (one definition); re-exported for the transport's users.
from parity.config.base import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from parity.config.base import is_loopback
from parity.v1 import common_pb2

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 16
_DTYPE_SIZES = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
SUPPORTED_DTYPES = frozenset(_DTYPE_SIZES)
_hosted_stores: dict[tuple[str, int], object] = {}
_hosted_lock = threading.Lock()


class TransferError(RuntimeError):
    """A transfer failed: timeout, peer gone, or bad metadata."""


def dtype_size(dtype: str) -> int:
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise TransferError(f"dtype: unsupported {dtype!r} (one of {sorted(_DTYPE_SIZES)})") from None


@dataclass(frozen=True)
class Layout:
    """Where each tensor sits in the packed stream."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total_bytes: int

    @classmethod
    def of(cls, metas: Sequence[common_pb2.TensorMeta]) -> Layout:
        offsets, sizes, cursor = [], [], 0
        for meta in metas:
            count = 1
            for dim in meta.shape:
                count *= int(dim)
            cursor = -(-cursor // ALIGN_BYTES) * ALIGN_BYTES
            offsets.append(cursor)
            sizes.append(count * dtype_size(meta.dtype))
            cursor += sizes[-1]
        return cls(tuple(offsets), tuple(sizes), cursor)

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        if bucket_bytes <= 0:
            raise TransferError(f"bucket_bytes: must be > 0 (got {bucket_bytes})")
        return [
            (s, min(s + bucket_bytes, self.total_bytes)) for s in range(0, self.total_bytes, bucket_bytes)
        ]


def views(buffer: torch.Tensor, metas: Sequence[common_pb2.TensorMeta], layout: Layout) -> list[torch.Tensor]:
    """Tensors of `metas` as views into a packed uint8 `buffer`."""
    import torch

    out = []
    for meta, offset, nbytes in zip(metas, layout.offsets, layout.nbytes, strict=True):
        dtype = getattr(torch, meta.dtype)
        out.append(buffer[offset : offset + nbytes].view(dtype).reshape(tuple(meta.shape)))
    return out


def pack(tensors: Sequence[torch.Tensor], layout: Layout, device: str = "cpu") -> torch.Tensor:
    """Copy tensors into one packed uint8 buffer following `layout`."""
    import torch

    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    for tensor, offset, nbytes in zip(tensors, layout.offsets, layout.nbytes, strict=True):
        buffer[offset : offset + nbytes] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return buffer


class StreamVerifier:
    """Checksums tensors as soon as their last byte has arrived (pass `advance` as `progress`), so
    the tail after the last bucket is one bucket's worth of checksums, not the whole version's."""

    def __init__(self, buffer: torch.Tensor, metas: Sequence[common_pb2.TensorMeta]) -> None:
        self.metas = list(metas)
        self.layout = Layout.of(self.metas)
        self.tensors = views(buffer, self.metas, self.layout)
        self.checksums: list[int] = []

    def advance(self, end: int) -> None:
        from parity.checksum import tensor_checksum

        while len(self.checksums) < len(self.metas):
            i = len(self.checksums)
            if self.layout.offsets[i] + self.layout.nbytes[i] > end:
                break
            self.checksums.append(tensor_checksum(self.tensors[i]))

    def mismatched(self) -> list[str]:
        """Names whose checksum differs from the metadata (call after the last `advance`)."""
        self.advance(self.layout.total_bytes)
        return [m.name for m, c in zip(self.metas, self.checksums, strict=True) if c != m.checksum]


def _layout_of_tensors(tensors: Sequence[torch.Tensor]) -> Layout:
    metas = [
        common_pb2.TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for t in tensors
    ]
    return Layout.of(metas)


def _hosted_store(host: str, port: int, timeout: datetime.timedelta) -> object:
    """Start (once per process) the TCPStore server that every group uses, keyed by prefix."""
    import torch.distributed as dist

    with _hosted_lock:
        store = _hosted_stores.get((host, port))
        if store is None:
            store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, multi_tenant=True)
            _hosted_stores[(host, port)] = store
        return store


class TransferGroup:
    """A standalone torch.distributed group for one transfer (see module docstring)."""

    def __init__(self, process_group: object, rank: int, world_size: int, backend: str, timeout_s: float):
        self._pg = process_group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s

    @classmethod
    def join(cls, rendezvous: common_pb2.Rendezvous, host_store: bool = False) -> TransferGroup:
        """Join the group named by `rendezvous`; blocks until every rank has joined or timeout_s."""
        import torch.distributed as dist

        rdv = rendezvous
        if rdv.backend not in ("gloo", "nccl"):
            raise TransferError(f"rendezvous.backend: must be gloo or nccl (got {rdv.backend!r})")
        if not 0 <= rdv.rank < rdv.world_size or rdv.world_size < 2:
            raise TransferError(f"rendezvous.rank: {rdv.rank} not in [0, world_size={rdv.world_size})")
        if not rdv.group_name or rdv.timeout_s <= 0 or not rdv.port:
            raise TransferError("rendezvous: group_name, port and timeout_s > 0 are required")
        timeout = datetime.timedelta(seconds=float(rdv.timeout_s))
        if host_store:
            _hosted_store(rdv.host, rdv.port, timeout)
        try:
            client = dist.TCPStore(rdv.host, rdv.port, None, False, timeout)
            store = dist.PrefixStore(f"parity/{rdv.group_name}/", client)
            if rdv.backend == "gloo":
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timeout
                if is_loopback(rdv.host):
                    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                else:
                    options._devices = [dist.ProcessGroupGloo.create_default_device()]
                pg = dist.ProcessGroupGloo(store, rdv.rank, rdv.world_size, options)
            else:
                import torch

                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                pg = dist.ProcessGroupNCCL(store, rdv.rank, rdv.world_size, options)
                # NCCL connects lazily; a tiny collective makes join() fail fast, like gloo.
                probe = torch.zeros(1, device="cuda")
                pg.allreduce([probe]).wait(timeout)
        except Exception as exc:  # translate: timeouts and connect errors look alike to callers
            raise TransferError(f"join {rdv.group_name} as rank {rdv.rank}: {exc}") from exc
        return cls(pg, rdv.rank, rdv.world_size, rdv.backend, float(rdv.timeout_s))

    # -- primitives -----------------------------------------------------------------------------
    def _issue(self, buffer: torch.Tensor) -> object:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            return self._pg.broadcast([buffer], opts)
        except Exception as exc:
            raise TransferError(f"broadcast of {buffer.numel()} bytes failed: {exc}") from exc

    def _wait(self, work: object, nbytes: int) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise TransferError(f"broadcast of {nbytes} bytes failed: {exc}") from exc

    def _broadcast(self, buffer: torch.Tensor) -> None:
        self._wait(self._issue(buffer), buffer.numel())

    # -- sender ---------------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> int:
        """Rank 0: broadcast `tensors` (packed, bucketed) to every other rank; returns bytes sent.

        Double-buffered: bucket i+1 is packed while bucket i is on the wire. A bucket that lies
        inside one tensor is sent as a view of it, with no packing copy (on a CPU host every copy
        competes with the transfer for the same cores)."""
        import torch

        if self.rank != 0:
            raise TransferError(f"send: only rank 0 sends (this is rank {self.rank})")
        layout = _layout_of_tensors(tensors)
        if not tensors:
            return 0
        device = tensors[0].device
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        size = min(bucket_bytes, layout.total_bytes)
        staging = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
        pending: tuple[object, int] | None = None
        for i, (start, end) in enumerate(layout.buckets(bucket_bytes)):
            bucket = staging[i % 2][: end - start]  # its last user (bucket i-2) has completed
            for flat, offset, nbytes in zip(flats, layout.offsets, layout.nbytes, strict=True):
                lo, hi = max(start, offset), min(end, offset + nbytes)
                if lo == start and hi == end:  # the whole bucket is inside this tensor
                    bucket = flat[lo - offset : hi - offset]
                    break
                if lo < hi:
                    bucket[lo - start : hi - start] = flat[lo - offset : hi - offset]
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            if pending is not None:
                self._wait(*pending)
            pending = (self._issue(bucket), end - start)
        if pending is not None:
            self._wait(*pending)
        return layout.total_bytes

    def send_packed(
        self,
        buffer: torch.Tensor,
        bucket_bytes: int,
        ready: Callable[[int], None] | None = None,
    ) -> int:
        """Rank 0: broadcast an already packed uint8 buffer. `ready(end)` blocks until bytes [0, end)
        are valid (lets the broadcast service forward a version while it is still arriving).
        One bucket in flight at a time: on a CPU-bound host two in flight measured slower."""
        layout = Layout((0,), (buffer.numel(),), buffer.numel())
        pending: tuple[object, int] | None = None
        for start, end in layout.buckets(bucket_bytes):
            if ready is not None:
                ready(end)
            if pending is not None:
                self._wait(*pending)
            work = self._issue(buffer[start:end])
            pending = (work, end - start)
        if pending is not None:
            self._wait(*pending)
        return buffer.numel()

    # -- receiver -------------------------------------------------------------------------------
    def recv_packed(
        self,
        metas: Sequence[common_pb2.TensorMeta],
        bucket_bytes: int,
        device: str = "cpu",
        progress: Callable[[int], None] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Ranks >= 1: receive the packed stream into a new uint8 buffer (or `out`); `progress(end)`
        is called once bytes [0, end) have arrived (e.g. to checksum the tensors finished so far, so
        that verification does not all wait for the last bucket)."""
        import torch

        if self.rank == 0:
            raise TransferError("recv: rank 0 is the sender")
        layout = Layout.of(metas)
        buffer = out if out is not None else torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        if buffer.numel() != layout.total_bytes:
            raise TransferError(f"out: {buffer.numel()} bytes, the plan needs {layout.total_bytes}")
        pending: tuple[object, int, int] | None = None
        for start, end in layout.buckets(bucket_bytes):
            if pending is not None:
                self._wait(pending[0], pending[1])
                if progress is not None:
                    progress(pending[2])
            work = self._issue(buffer[start:end])
            pending = (work, end - start, end)
        if pending is not None:
            self._wait(pending[0], pending[1])
            if progress is not None:
                progress(pending[2])
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
        except Exception:  # best effort: the group is being discarded either way
            pass
