"""Membership of rollout workers and the epochs of the data group.

Invariants:
- One record per worker_id. Registering again (a restarted worker) replaces the record.
- A worker's recorded `weight_version` comes only from a verified ack (its reported checksums equal
  the trainer's); `verified` says so. A registration's self-report is kept as `claimed_version` (it
  only decides whether the worker needs a catch-up); heartbeats prove liveness and nothing else.
- A membership epoch is one data group: the trainer as rank 0 and the epoch's workers as ranks 1..N,
  with a fresh group name and secret. Any join, leave, drop or failed transfer marks the epoch stale;
  the next version then forms a new epoch from the live workers that are not excluded. Groups are
  never reused after a failure, so a new epoch never meets an old epoch's store keys.
- An epoch belongs to one publisher (`PublishVersionRequest.publisher_id`, one per trainer process).
  A publish from another publisher (a restarted trainer) starts a new epoch even when the workers
  are the same: the workers still hold the old epoch's group, and a newcomer joining it as rank 0
  would wait out the rendezvous timeout alone.
- A worker reports at registration how many bytes it can receive a version into
  (`receive_capacity_bytes`, 0: unknown); `capacity_problem` refuses a version no worker can hold.
- A worker that never joined a group, or could not be reached, is excluded from epochs for
  `exclude_s`, so one dead member cannot fail version after version.
- A worker silent for `heartbeat_timeout_s` is dropped, except while an update to it is in flight.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field

import grpc

from parity.errors import RequestError, invalid, quote
from parity.v1 import broadcast_pb2 as pb

WorkerState = pb.WorkerState
_WORKER_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
DEVICE_UUID = re.compile(r"^[A-Za-z0-9-]{0,128}$")
PUBLISHER_ID = re.compile(r"^[A-Za-z0-9._:-]{0,128}$")


@dataclass
class WorkerRecord:
    worker_id: str
    address: str
    claimed_version: int
    weight_version: int = 0  # verified only (see the module docstring)
    verified: bool = False
    state: int = WorkerState.WORKER_STATE_SERVING
    last_error: str = ""
    last_heartbeat_unix: float = field(default_factory=time.time)
    last_seen_monotonic: float = field(default_factory=time.monotonic)
    updates_applied: int = 0
    updates_failed: int = 0
    attempted_version: int = 0
    last_failure_monotonic: float = 0.0
    last_update_seconds: float | None = None  # None: not measured (no attempt yet)
    last_paused_seconds: float | None = None  # None: not measured (no attempt, or no reply)
    excluded_until: float = 0.0  # monotonic; kept out of epochs until then
    epoch: int = 0
    busy: bool = False  # an UpdateWeights to it is in flight
    device_uuid: str = ""  # the GPU its engine runs on ("" on CPU)
    receive_capacity_bytes: int = 0  # bytes it can receive a version into (0: not reported)

    @property
    def known_version(self) -> int:
        """What the worker holds, as well as the service knows it (verified, else its claim)."""
        return self.weight_version if self.verified else self.claimed_version

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            weight_version=self.weight_version,
            state=self.state,
            last_error=self.last_error,
            last_heartbeat_unix=self.last_heartbeat_unix,
            updates_applied=self.updates_applied,
            updates_failed=self.updates_failed,
            last_update_seconds=self.last_update_seconds,
            last_paused_seconds=self.last_paused_seconds,
            last_attempted_version=self.attempted_version,
            verified=self.verified,
            epoch=self.epoch,
            device_uuid=self.device_uuid,
        )


@dataclass(frozen=True)
class Epoch:
    """One data group: its number, members in rank order (rank 1 first), name and secret, plus the
    workers on the trainer's GPU (`ipc_members`), which get each version by CUDA IPC instead."""

    number: int
    members: tuple[str, ...]
    group_name: str
    secret: str
    ipc_members: tuple[str, ...] = ()
    trainer_device: str = ""
    publisher_id: str = ""  # the trainer process that is rank 0 of this epoch's group


def validate_registration(request: pb.RegisterWorkerRequest) -> None:
    if not _WORKER_ID.match(request.worker_id):
        raise invalid("worker_id", "1-128 characters from [A-Za-z0-9._:@-]")
    host, sep, port = request.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid(
            "address", f"expected HOST:PORT of the worker's RolloutService (got {quote(request.address)})"
        )
    if request.weight_version < 0:
        raise invalid("weight_version", f"must be >= 0 (got {request.weight_version})")
    if not DEVICE_UUID.match(request.device_uuid):
        raise invalid("device_uuid", f"empty (CPU) or a GPU UUID of 1-128 characters from [A-Za-z0-9-] "
                      f"(got {quote(request.device_uuid)})")  # fmt: skip
    if request.receive_capacity_bytes < 0:
        raise invalid(
            "receive_capacity_bytes", f"must be >= 0 (0: not reported; got {request.receive_capacity_bytes})"
        )


class Membership:
    """Live workers by id, the recently dropped ones for GetStatus, and the current epoch."""

    def __init__(self, max_workers: int, heartbeat_timeout_s: float, exclude_s: float) -> None:
        self.max_workers = max_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.exclude_s = exclude_s
        self.live: dict[str, WorkerRecord] = {}
        self.dropped: dict[str, WorkerRecord] = {}
        self.epoch = Epoch(0, (), "", "")
        self.stale = True

    def register(self, request: pb.RegisterWorkerRequest) -> WorkerRecord:
        """Add (or replace) a worker."""
        validate_registration(request)
        if request.worker_id not in self.live and len(self.live) >= self.max_workers:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "worker_id",
                f"max_workers={self.max_workers} already registered",
            )
        record = WorkerRecord(
            worker_id=request.worker_id,
            address=request.address,
            claimed_version=request.weight_version,
            attempted_version=request.weight_version,
            device_uuid=request.device_uuid,
            receive_capacity_bytes=request.receive_capacity_bytes,
        )
        self.live[record.worker_id] = record
        self.dropped.pop(record.worker_id, None)
        self.stale = True
        return record

    def heartbeat(self, request: pb.HeartbeatRequest) -> WorkerRecord:
        record = self.live.get(request.worker_id)
        if record is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                "worker_id",
                f"{quote(request.worker_id)} is not registered (dropped or never joined); call RegisterWorker",
            )
        record.last_seen_monotonic = time.monotonic()
        record.last_heartbeat_unix = time.time()
        return record

    def unregister(self, worker_id: str) -> WorkerRecord | None:
        record = self.live.pop(worker_id, None)
        if record is not None:
            self.stale = True
        return record

    def exclude(self, worker_id: str, reason: str) -> None:
        record = self.live.get(worker_id)
        if record is not None:
            record.excluded_until = time.monotonic() + self.exclude_s
            record.last_error = reason
        self.stale = True

    def expired(self) -> list[WorkerRecord]:
        """Remove and return workers silent for longer than the heartbeat timeout."""
        now = time.monotonic()
        gone = [
            r
            for r in self.live.values()
            if not r.busy and now - r.last_seen_monotonic > self.heartbeat_timeout_s
        ]
        for record in gone:
            record.state = WorkerState.WORKER_STATE_DROPPED
            self.live.pop(record.worker_id, None)
            self.dropped[record.worker_id] = record
            while len(self.dropped) > 100:
                self.dropped.pop(next(iter(self.dropped)))
            self.stale = True
        return gone

    def eligible(self) -> list[WorkerRecord]:
        now = time.monotonic()
        return [r for r in self.live.values() if r.excluded_until <= now]

    def capacity_problem(self, total_bytes: int) -> str:
        """Why no live worker can hold a version of `total_bytes` ("" when one may): refused only
        when every live worker reported a capacity and each is smaller. A worker that reported none
        (0) may hold it, and with no worker at all there is nobody to judge by."""
        workers = list(self.live.values())
        if not workers or any(w.receive_capacity_bytes <= 0 for w in workers):
            return ""
        largest = max(workers, key=lambda w: w.receive_capacity_bytes)
        if total_bytes <= largest.receive_capacity_bytes:
            return ""
        return (
            f"{total_bytes} bytes exceed what every registered worker can receive into (largest: "
            f"{largest.receive_capacity_bytes} bytes at {largest.worker_id}, of {len(workers)} worker(s))"
        )

    def current_epoch(self, trainer_device: str = "", publisher_id: str = "") -> tuple[Epoch, bool]:
        """The epoch the next version goes to: (epoch, whether it is new). A stale epoch, one
        whose members are no longer the eligible workers, or one another publisher (`publisher_id`:
        a restarted trainer) was rank 0 of, is replaced. Workers registered on
        `trainer_device` (the trainer's GPU; "" on CPU) are the epoch's IPC members, not ranks of
        its group: no two ranks of one group may share a GPU."""
        eligible = self.eligible()
        ipc = tuple(r.worker_id for r in eligible if trainer_device and r.device_uuid == trainer_device)
        members = tuple(r.worker_id for r in eligible if r.worker_id not in ipc)
        if (
            self.stale
            or members != self.epoch.members
            or ipc != self.epoch.ipc_members
            or trainer_device != self.epoch.trainer_device
            or publisher_id != self.epoch.publisher_id
            or self.epoch.number == 0
        ):
            number = self.epoch.number + 1
            self.epoch = Epoch(
                number,
                members,
                f"epoch{number}-{secrets.token_hex(4)}",
                secrets.token_hex(16),
                ipc,
                trainer_device,
                publisher_id,
            )
            self.stale = False
            return self.epoch, True
        return self.epoch, False
