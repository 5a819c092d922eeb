"""Tensor transport over torch.distributed: one code path for gloo (CPU) and NCCL (GPU).

A transfer is a byte stream. Tensors are laid out back to back (each start aligned to `ALIGN_BYTES`)
in one packed stream of `total_bytes`, and the stream moves as consecutive buckets of at most
`bucket_bytes` from rank 0 to every other rank, never one op per tensor: on NCCL one `broadcast` per
bucket, on gloo a chain (rank 0 sends each bucket to rank 1, which forwards it to rank 2 as it lands,
...; see `ALGORITHMS`). Both sides derive the identical layout from the metadata alone.

Invariants:
- The sender is rank 0 (the trainer); receivers are ranks >= 1 (rollout workers). The broadcast
  service hosts the TCPStore, bound to the configured data host only (loopback by default), and never
  joins a group: it moves no tensor bytes. Each group lives under its own store prefix
  (`Rendezvous.group_name`), so many groups share one store port.
- Joining needs the group's secret (`Rendezvous.secret`, handed out over authenticated gRPC). It is
  never written to the store: after the group forms, every rank all-gathers HMAC(secret, group/rank)
  and the join fails unless every peer proved it knows the secret, before any weight moves.
- Two ranks of one NCCL group on one GPU are refused before NCCL is touched: ranks publish their
  device UUIDs in the store and a duplicate fails every rank's join with the two ranks named.
- Groups are standalone `ProcessGroup` objects, never the process-wide default group, so a process
  can hold several groups at once and lose one without affecting the others. `GroupHolder` keeps one
  persistent group per membership epoch and rebuilds it when the plan names another group.
- Every wait -- rendezvous, connect, each bucket -- fails after `Rendezvous.timeout_s` (finite,
  <= MAX_TIMEOUT_S) with an exception; nothing hangs. A peer that dies mid-transfer raises on the
  other side, and a group that saw a failure is discarded, never reused.
- `recv` returns views into one freshly allocated buffer: received bytes never touch tensors the
  caller is serving from (atomicity is the caller's swap).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import math
import socket
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
# The most any rendezvous may ask a collective to wait (the broadcast's transfer_timeout_s is capped
# at the same value): a NaN, infinite or absurd timeout is refused, never passed to a collective.
MAX_TIMEOUT_S = 3600.0
_DIGEST_BYTES = 32
_hosted_stores: dict[tuple[str, int], object] = {}
_hosted_lock = threading.Lock()


# How buckets move through a group. "broadcast": one collective per bucket (NCCL's broadcast is a
# pipelined ring). "chain": rank 0 sends each bucket to rank 1, which forwards it to rank 2 as soon as
# it has landed, and so on: gloo's broadcast has the root send every receiver its own copy, so the
# root's cores carry N copies; a chain carries one per link and pipelines them (gloo groups).
ALGORITHMS = ("broadcast", "chain")
_CHAIN_DEPTH_CUDA = 2  # chain over gloo with CUDA buffers: receives posted at once (pinned bounces)


def default_algorithm(backend: str) -> str:
    return "chain" if backend == "gloo" else "broadcast"


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


def packed_in_place(tensors: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """The uint8 stream itself when `tensors` already lie in one buffer exactly as `layout` packs
    them (see `allocate_packed`); None otherwise. Sending it then copies nothing."""
    import torch

    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    base = first.storage_offset() * first.element_size() - layout.offsets[0]
    if base < 0 or base + layout.total_bytes > storage.nbytes():
        return None
    for tensor, offset in zip(tensors, layout.offsets, strict=True):
        if (
            not tensor.is_contiguous()
            or tensor.device != first.device
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() * tensor.element_size() != base + offset
        ):
            return None
    whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return whole[base : base + layout.total_bytes]


def allocate_packed(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 buffer in the transport's layout and, in it, copies of `tensors` as views. A
    sender whose tensors live there (a trainer's flattened parameters) sends with no packing copy."""
    layout = _layout_of_tensors(tensors)
    metas = [
        common_pb2.TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for t in tensors
    ]
    import torch

    device = tensors[0].device if tensors else "cpu"
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    placed = views(buffer, metas, layout)
    for view, tensor in zip(placed, tensors, strict=True):
        view.copy_(tensor.detach())
    return buffer, placed


class StreamVerifier:
    """Checksums a packed stream as it arrives (pass `advance` as `progress`).

    In host memory each bucket's share of every tensor is summed as soon as the bucket lands
    (`checksum.checksum_update`), while the next buckets are on the wire, so no byte is read twice
    and the tail after the last bucket is one bucket's worth of work. On a GPU a tensor is
    checksummed whole once its last byte has arrived."""

    def __init__(self, buffer: torch.Tensor, metas: Sequence[common_pb2.TensorMeta]) -> None:
        self.metas = list(metas)
        self.layout = Layout.of(self.metas)
        self.tensors = views(buffer, self.metas, self.layout)
        self.checksums: list[int] = []  # finished tensors, in plan order
        self._host = None if buffer.is_cuda else buffer.numpy()
        self._partial = 0  # the next tensor's checksum over its first `_done` bytes (host memory)
        self._done = 0

    def advance(self, end: int) -> None:
        """Bytes [0, end) of the stream have arrived."""
        from parity.checksum import checksum_update, tensor_checksum

        layout = self.layout
        while len(self.checksums) < len(self.metas):
            i = len(self.checksums)
            offset, nbytes = layout.offsets[i], layout.nbytes[i]
            arrived = min(end, offset + nbytes) - offset
            if self._host is None:
                if arrived < nbytes:
                    return
                self.checksums.append(tensor_checksum(self.tensors[i]))
                continue
            upto = nbytes if arrived >= nbytes else max(0, arrived - arrived % 8)
            if upto > self._done:
                lo = offset + self._done
                self._partial = checksum_update(self._partial, self._host[lo : offset + upto], self._done)
                self._done = upto
            if upto < nbytes:
                return
            self.checksums.append(self._partial)
            self._partial, self._done = 0, 0

    def mismatched(self) -> list[str]:
        """Names whose checksum differs from the metadata (call after the last `advance`)."""
        self.advance(self.layout.total_bytes)
        return [m.name for m, c in zip(self.metas, self.checksums, strict=True) if c != m.checksum]


def _layout_of_tensors(tensors: Sequence[torch.Tensor]) -> Layout:
    metas = [
        common_pb2.TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for t in tensors
    ]
    return Layout.of(metas)


def rendezvous_problem(rdv: common_pb2.Rendezvous) -> tuple[str, str] | None:
    """(field, what is wrong) for a rendezvous no group may be joined with, else None."""
    if rdv.backend not in ("gloo", "nccl"):
        return "backend", f"must be gloo or nccl (got {rdv.backend!r})"
    if rdv.world_size < 1 or not 0 <= rdv.rank < rdv.world_size:
        return "rank", f"{rdv.rank} not in [0, world_size={rdv.world_size})"
    if not rdv.host or not 0 < rdv.port < 65536:
        return "port", f"host and a port in 1..65535 are required (got {rdv.host!r}:{rdv.port})"
    if not rdv.group_name:
        return "group_name", "required"
    if not math.isfinite(rdv.timeout_s) or not 0 < rdv.timeout_s <= MAX_TIMEOUT_S:
        return "timeout_s", f"must be finite and in (0, {MAX_TIMEOUT_S:.0f}] seconds (got {rdv.timeout_s})"
    if len(rdv.secret) < 16:
        return "secret", "the group's secret (>= 16 characters) is required to join"
    return None


def check_rendezvous(rdv: common_pb2.Rendezvous) -> None:
    """Raise TransferError naming the field when `rdv` may not be joined (see rendezvous_problem)."""
    problem = rendezvous_problem(rdv)
    if problem is not None:
        raise TransferError(f"rendezvous.{problem[0]}: {problem[1]}")


def serve_store(host: str, port: int, timeout_s: float = 60.0) -> object:
    """Start (once per process) the TCPStore server every group uses, keyed by prefix. It listens on
    `host` only: the socket is bound here and handed to the store (torch's own server would bind
    every interface whatever host it is given)."""
    import torch.distributed as dist

    with _hosted_lock:
        store = _hosted_stores.get((host, port))
        if store is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(1024)
            bound_port = listener.getsockname()[1]
            store = dist.TCPStore(
                host, bound_port, None, True, datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False, multi_tenant=True, master_listen_fd=listener.detach(),
            )  # fmt: skip
            _hosted_stores[(host, port)] = store
            _hosted_stores[(host, bound_port)] = store
        return store


def stop_hosted_stores() -> None:
    """Forget the hosted stores (their server stops when the last reference goes)."""
    with _hosted_lock:
        _hosted_stores.clear()


def secret_proof(secret: str, group_name: str, rank: int) -> bytes:
    """What rank `rank` of `group_name` presents to prove it was given the group's secret."""
    return hmac.new(secret.encode(), f"{group_name}/{rank}".encode(), hashlib.sha256).digest()


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


def refuse_shared_devices(
    store: object, rank: int, world_size: int, device_uuid: str, timeout_s: float
) -> None:
    """Publish this rank's device UUID and fail if two ranks of the group report the same one
    (before NCCL is touched: NCCL would fail with `Duplicate GPU detected`, or worse, hang)."""
    import torch.distributed as dist

    store.set(f"device/{rank}", device_uuid)  # type: ignore[attr-defined]
    keys = [f"device/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
    except (dist.DistStoreError, RuntimeError) as exc:
        raise TransferError(f"device check: not every rank reported its device in {timeout_s:.0f}s") from exc
    seen: dict[str, int] = {}
    for r, raw in enumerate(store.multi_get(keys)):  # type: ignore[attr-defined]
        uuid = bytes(raw).decode()
        if uuid in seen:
            raise TransferError(
                f"topology: ranks {seen[uuid]} and {r} of this group are on the same GPU ({uuid}); "
                "NCCL refuses two ranks of one group on one device (use CUDA IPC for a colocated engine)"
            )
        seen[uuid] = r


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
        import torch.distributed as dist

        rdv = rendezvous
        check_rendezvous(rdv)
        if rdv.world_size < 2:
            raise TransferError(f"rendezvous.world_size: a group needs a receiver (got {rdv.world_size})")
        timeout = datetime.timedelta(seconds=float(rdv.timeout_s))
        if host_store:
            serve_store(rdv.host, rdv.port, float(rdv.timeout_s))
        pg = None
        try:
            client = dist.TCPStore(rdv.host, rdv.port, None, False, timeout)
            store = dist.PrefixStore(f"parity/{rdv.group_name}/", client)
            store.set(f"joined/{rdv.rank}", "1")  # lets the service name ranks that never came
            if rdv.backend == "nccl" and not device_uuid:
                device_uuid = cuda_device_uuid()
            if device_uuid:
                refuse_shared_devices(store, rdv.rank, rdv.world_size, device_uuid, float(rdv.timeout_s))
            if rdv.backend == "gloo":
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timeout
                if is_loopback(rdv.host):
                    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                else:
                    options._devices = [dist.ProcessGroupGloo.create_default_device()]
                pg = dist.ProcessGroupGloo(store, rdv.rank, rdv.world_size, options)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                pg = dist.ProcessGroupNCCL(store, rdv.rank, rdv.world_size, options)
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
            torch.zeros(_DIGEST_BYTES, dtype=torch.uint8, device=device) for _ in range(self.world_size)
        ]
        work = self._pg.allgather([outputs], [mine.to(device)])  # type: ignore[attr-defined]
        self._wait(work, _DIGEST_BYTES * self.world_size)
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

    def _broadcast(self, buffer: torch.Tensor) -> None:
        self._wait(self._issue(buffer), buffer.numel())

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
        layout = _layout_of_tensors(tensors)
        if not tensors:
            return 0
        in_place = packed_in_place(tensors, layout)
        if in_place is not None:  # already one packed stream (flattened parameters): no copy at all
            if in_place.device.type == "cuda":
                torch.cuda.current_stream(in_place.device).synchronize()
            return self.send_packed(in_place, bucket_bytes)
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
        slow link)."""
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
        depth = len(buckets) if ahead <= 0 else ahead
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
        except Exception:  # best effort: the group is being discarded either way
            pass


ONE_SHOT_PREFIX = "catchup-"  # groups named so are joined for one transfer and closed after it


class GroupHolder:
    """The persistent data group of one membership epoch, as one rank holds it.

    `use(rdv)` yields the held group while plans name it (joining costs one rendezvous per epoch,
    not per version) and joins the named one otherwise, closing the old. A group that raised is
    discarded: after a timeout or a dead peer, gloo and NCCL groups are not reusable. Groups whose
    name starts with ONE_SHOT_PREFIX (catch-up transfers) are joined and closed around one use and
    leave the held epoch group alone."""

    def __init__(self) -> None:
        self.group: TransferGroup | None = None
        self.name = ""
        self._lock = threading.Lock()

    def use(self, rdv: common_pb2.Rendezvous) -> _HeldGroup:
        return _HeldGroup(self, rdv)

    def _acquire(self, rdv: common_pb2.Rendezvous) -> TransferGroup:
        if rdv.group_name.startswith(ONE_SHOT_PREFIX):
            return TransferGroup.join(rdv)
        held = self.group
        if (
            held is not None
            and self.name == rdv.group_name
            and (held.rank, held.world_size)
            == (
                rdv.rank,
                rdv.world_size,
            )
        ):
            return held
        self.close()
        self.group, self.name = TransferGroup.join(rdv), rdv.group_name
        return self.group

    def close(self) -> None:
        """Tear the held group down (best effort, bounded by the group's own timeout)."""
        group, self.group, self.name = self.group, None, ""
        if group is not None:
            group.close()


class _HeldGroup:
    def __init__(self, holder: GroupHolder, rdv: common_pb2.Rendezvous) -> None:
        self.holder, self.rdv, self.group = holder, rdv, None

    def __enter__(self) -> TransferGroup:
        self.holder._lock.acquire()
        try:
            self.group = self.holder._acquire(self.rdv)
        except BaseException:
            self.holder._lock.release()
            raise
        return self.group

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.rdv.group_name.startswith(ONE_SHOT_PREFIX):
                self.group.close()
            elif exc_type is not None:
                self.holder.close()  # a group that failed is never reused
        finally:
            self.holder._lock.release()


def available_bytes(device: str) -> int | None:
    """Free memory where a receive buffer would go (None when it cannot be measured)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
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
