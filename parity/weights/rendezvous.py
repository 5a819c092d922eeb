"""Forming a data group: the hosted store, the rendezvous fields, the group's secret, the GPU check.

Invariants:
- The broadcast service hosts the TCPStore (`serve_store`), bound to the configured data host only
  (loopback by default), for the life of its process, and never joins a group: it moves no tensor
  bytes. Each group lives under its own store prefix (`group_store`), so many groups share one port.
- Joining needs the group's secret (`Rendezvous.secret`, handed out over authenticated gRPC). It is
  never written to the store: after the group forms, every rank all-gathers
  `secret_proof` = HMAC(secret, group/rank) and the join fails unless every peer proved it knows
  the secret, before any weight moves (`wire.TransferGroup.join`).
- Two ranks of one NCCL group on one GPU are refused before NCCL is touched: ranks publish their
  device UUIDs in the store and a duplicate fails every rank's join with the two ranks named.
- Every wait is bounded by `Rendezvous.timeout_s`, finite and <= MAX_TIMEOUT_S: a rendezvous that
  breaks a rule (`rendezvous_problem`) is refused before anything connects.
- Groups named with ONE_SHOT_PREFIX (catch-ups) are joined for one transfer and closed after it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import math
import socket
import threading
from typing import TYPE_CHECKING

from parity.config.base import is_loopback
from parity.v1 import common_pb2
from parity.weights.devices import cuda_device_uuid
from parity.weights.layout import TransferError

if TYPE_CHECKING:
    import torch.distributed as dist

# The most any rendezvous may ask a collective to wait (the broadcast's transfer_timeout_s is capped
# at the same value): a NaN, infinite or absurd timeout is refused, never passed to a collective.
MAX_TIMEOUT_S = 3600.0
ONE_SHOT_PREFIX = "catchup-"  # groups named so are joined for one transfer and closed after it
DIGEST_BYTES = 32  # one `secret_proof`
_hosted_stores: dict[tuple[str, int], object] = {}
_hosted_lock = threading.Lock()


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
    every interface whatever host it is given). It serves until the process exits."""
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


def group_store(rdv: common_pb2.Rendezvous) -> dist.PrefixStore:
    """A client of the hosted store, under the prefix of `rdv`'s group (connects within timeout_s)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(rdv.timeout_s))
    client = dist.TCPStore(rdv.host, rdv.port, None, False, timeout)
    return dist.PrefixStore(f"parity/{rdv.group_name}/", client)


def secret_proof(secret: str, group_name: str, rank: int) -> bytes:
    """What rank `rank` of `group_name` presents to prove it was given the group's secret."""
    return hmac.new(secret.encode(), f"{group_name}/{rank}".encode(), hashlib.sha256).digest()


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
    try:
        values = store.multi_get(keys)  # type: ignore[attr-defined]
    except (dist.DistStoreError, RuntimeError) as exc:
        raise TransferError(f"device check: the group's store went away while reading ({exc})") from exc
    # Every rank has read before any leaves: the store may live in a rank's process (host_store),
    # and a rank refused below exits; the others would then read a closed store, not the refusal.
    store.set(f"device_read/{rank}", "1")  # type: ignore[attr-defined]
    with contextlib.suppress(dist.DistStoreError, RuntimeError):
        store.wait(  # type: ignore[attr-defined]
            [f"device_read/{r}" for r in range(world_size)], datetime.timedelta(seconds=min(10.0, timeout_s))
        )
    seen: dict[str, int] = {}
    for r, raw in enumerate(values):
        uuid = bytes(raw).decode()
        if uuid in seen:
            raise TransferError(
                f"topology: ranks {seen[uuid]} and {r} of this group are on the same GPU ({uuid}); "
                "NCCL refuses two ranks of one group on one device (use CUDA IPC for a colocated engine)"
            )
        seen[uuid] = r


def open_process_group(rdv: common_pb2.Rendezvous, device_uuid: str = "") -> object:
    """The standalone gloo or NCCL `ProcessGroup` of `rdv` (never the process-wide default group):
    marks this rank as arrived in the store (the service names ranks that never came), runs the
    shared-GPU check (always on NCCL, with the current CUDA device unless `device_uuid` is given; on
    gloo only when it is), then blocks until every rank has joined or timeout_s. Raises what torch
    raises; the caller translates it."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(rdv.timeout_s))
    store = group_store(rdv)
    store.set(f"joined/{rdv.rank}", "1")
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
        return dist.ProcessGroupGloo(store, rdv.rank, rdv.world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    # A failed weight transfer (a peer gone, a timeout) must fail its work here, so that the caller
    # raises TransferError (a retry, the next epoch), not make NCCL's watchdog end this process:
    # torch's default (SkipCleanUp) and torchrun's (TearDown) do. CleanUpOnly aborts the group's
    # communicators and fails its work; the group reads the setting when it is constructed.
    from parity.procs import temporary_environment

    with temporary_environment(TORCH_NCCL_ASYNC_ERROR_HANDLING=NCCL_CLEAN_UP_ONLY):
        return dist.ProcessGroupNCCL(store, rdv.rank, rdv.world_size, options)


NCCL_CLEAN_UP_ONLY = "2"  # c10d ErrorHandlingMode::CleanUpOnly
