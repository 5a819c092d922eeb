"""Membership of rollout workers: register, heartbeat, drop on silence.

Invariants:
- One record per worker_id. Registering again (a restarted worker) replaces the record: the new
  incarnation reports the version it loaded, and the fan-out brings it to the latest before it serves.
- A worker silent for `heartbeat_timeout_s` is dropped, except while an update to it is in flight
  (that update has its own deadline, after which the worker is judged again).
- `weight_version` is what the worker serves as far as the service knows: set from its registration,
  from acknowledged updates, and from heartbeats while no update is in flight.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import grpc

from parity.errors import RequestError, invalid
from parity.v1 import broadcast_pb2 as pb

WorkerState = pb.WorkerState
_WORKER_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


@dataclass
class WorkerRecord:
    worker_id: str
    address: str
    weight_version: int
    state: int = WorkerState.WORKER_STATE_SERVING
    last_error: str = ""
    last_heartbeat_unix: float = field(default_factory=time.time)
    last_seen_monotonic: float = field(default_factory=time.monotonic)
    updates_applied: int = 0
    updates_failed: int = 0
    attempted_version: int = 0
    last_failure_monotonic: float = 0.0
    last_update_seconds: float = 0.0
    last_paused_seconds: float = 0.0
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    driver: asyncio.Task | None = None

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
        )

    @property
    def updating(self) -> bool:
        return self.state == WorkerState.WORKER_STATE_UPDATING


def validate_registration(request: pb.RegisterWorkerRequest) -> None:
    if not _WORKER_ID.match(request.worker_id):
        raise invalid("worker_id", "1-128 characters from [A-Za-z0-9._:@-]")
    host, sep, port = request.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise invalid(
            "address", f"expected HOST:PORT of the worker's RolloutService (got {request.address!r})"
        )
    if request.weight_version < 0:
        raise invalid("weight_version", f"must be >= 0 (got {request.weight_version})")


class Membership:
    """Live workers by id, plus the recently dropped ones for GetStatus."""

    def __init__(self, max_workers: int, heartbeat_timeout_s: float) -> None:
        self.max_workers = max_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.live: dict[str, WorkerRecord] = {}
        self.dropped: dict[str, WorkerRecord] = {}

    def register(self, request: pb.RegisterWorkerRequest) -> tuple[WorkerRecord, WorkerRecord | None]:
        """Add (or replace) a worker; returns (new record, replaced record or None)."""
        validate_registration(request)
        previous = self.live.pop(request.worker_id, None)
        if previous is None and len(self.live) >= self.max_workers:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "worker_id",
                f"max_workers={self.max_workers} already registered",
            )
        record = WorkerRecord(
            worker_id=request.worker_id,
            address=request.address,
            weight_version=request.weight_version,
            attempted_version=request.weight_version,
        )
        self.live[record.worker_id] = record
        self.dropped.pop(record.worker_id, None)
        return record, previous

    def heartbeat(self, request: pb.HeartbeatRequest) -> WorkerRecord:
        record = self.live.get(request.worker_id)
        if record is None:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "worker_id",
                f"{request.worker_id!r} is not registered (dropped or never joined); call RegisterWorker",
            )
        if request.weight_version < 0:
            raise invalid("weight_version", "must be >= 0")
        record.last_seen_monotonic = time.monotonic()
        record.last_heartbeat_unix = time.time()
        # Only upwards: a heartbeat sent before a swap can arrive after its ack. A worker's version
        # goes down only by restarting, and a restart re-registers.
        if not record.updating and request.weight_version > record.weight_version:
            record.weight_version = request.weight_version  # the worker knows what it serves
            record.attempted_version = max(record.attempted_version, request.weight_version)
            record.kick.set()
        return record

    def unregister(self, worker_id: str) -> WorkerRecord | None:
        return self.live.pop(worker_id, None)

    def expired(self) -> list[WorkerRecord]:
        """Remove and return workers silent for longer than the heartbeat timeout."""
        now = time.monotonic()
        gone = [
            r
            for r in self.live.values()
            if not r.updating and now - r.last_seen_monotonic > self.heartbeat_timeout_s
        ]
        for record in gone:
            record.state = WorkerState.WORKER_STATE_DROPPED
            self.live.pop(record.worker_id, None)
            self.dropped[record.worker_id] = record
            while len(self.dropped) > 100:
                self.dropped.pop(next(iter(self.dropped)))
        return gone

    def attempted_versions(self) -> list[int]:
        return [r.attempted_version for r in self.live.values()]
