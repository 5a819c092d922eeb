"""`parity.v1.WeightBroadcastService`: the gRPC face of registry, membership epochs and coordinator.

Invariants:
- Every RPC validates its input first and answers INVALID_ARGUMENT / FAILED_PRECONDITION /
  RESOURCE_EXHAUSTED with details naming the field; a bad request never changes state. Heartbeat
  and UnregisterWorker for a worker that is not registered answer NOT_FOUND (the membership client
  registers again on it).
- Every RPC that changes state needs the token when one is set: PublishVersion, AwaitCatchUp,
  RegisterWorker, UnregisterWorker and Heartbeat (GrpcServer's protected methods).
- PublishVersion refuses, before any state changes, a version larger than every registered worker
  reports it can receive into (RESOURCE_EXHAUSTED naming `tensors`): nobody could hold it.
- A publish from a new `publisher_id` (a restarted trainer) starts a new membership epoch.
- PublishVersion returns the plan at once (the epoch's group, rank 0); the coordinator tells the
  workers. The service moves no tensor bytes: it hosts the TCPStore and keeps the books.
- State is mutated only on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc

from broadcast import delta, telemetry
from broadcast.coordinator import Coordinator
from broadcast.events import EventLog, Kind
from broadcast.membership import DEVICE_UUID, PUBLISHER_ID, Epoch, Membership, WorkerState
from broadcast.registry import VersionRecord, VersionRegistry, is_final_for, reached
from parity import tracing
from parity.config.broadcast import BroadcastConfig
from parity.errors import RequestError, invalid, quote
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc
from parity.weights.cuda_ipc import handle_problem
from parity.weights.layout import Layout

log = logging.getLogger(__name__)
SERVICE = "parity.v1.WeightBroadcastService"
PROTECTED_METHODS = tuple(
    f"/{SERVICE}/{m}"
    for m in (
        "PublishVersion",
        "AwaitCatchUp",
        "RegisterWorker",
        "UnregisterWorker",
        "Heartbeat",
        "OfferIpcBuffer",
    )
)
MAX_WAIT_S = 3600.0


class WeightBroadcastService(broadcast_pb2_grpc.WeightBroadcastServiceServicer):
    def __init__(self, config: BroadcastConfig, store_port: int) -> None:
        self.config = config
        self.store_port = store_port
        self.events = EventLog()
        self.registry = VersionRegistry(self.events, config.history_versions, config.max_version_bytes)
        self.membership = Membership(
            config.max_workers, config.heartbeat_timeout_s, exclude_s=config.retry_failed_after_s
        )
        self.coordinator = Coordinator(config, self.registry, self.membership, store_port, self._changed)
        self._tasks: set[asyncio.Task] = set()

    # -- background -----------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _changed(self) -> None:
        telemetry.LATEST_VERSION.set(self.registry.latest_committed)
        telemetry.WORKERS.set(len(self.membership.live))

    async def reap_forever(self) -> None:
        """Drop silent workers (a new epoch forms at the next version)."""
        period = min(1.0, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            for worker in self.membership.expired():
                log.warning(
                    "worker %s dropped: no heartbeat for %.0fs",
                    worker.worker_id,
                    self.config.heartbeat_timeout_s,
                )
                self.events.emit(
                    Kind.VERSION_EVENT_KIND_WORKER_DROPPED, worker.weight_version, worker.worker_id
                )
            self._changed()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.coordinator.close()

    # -- RPCs -----------------------------------------------------------------------------------
    async def PublishVersion(self, request: pb.PublishVersionRequest, context: grpc.aio.ServicerContext):
        attrs = {"parity.weight_version": request.version, "parity.model": request.model}
        with tracing.span("publish_version", attrs):  # inside the interceptor's server span
            try:
                self.registry.validate(request)
                if not DEVICE_UUID.match(request.device_uuid):
                    raise invalid("device_uuid", "empty (CPU) or a GPU UUID of 1-128 characters [A-Za-z0-9-]")
                if not PUBLISHER_ID.match(request.publisher_id):
                    raise invalid("publisher_id", "empty or 1-128 characters from [A-Za-z0-9._:-]")
                problem = self.membership.capacity_problem(Layout.of(request.tensors).total_bytes)
                if problem:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tensors", problem)
            except RequestError as exc:
                await context.abort(exc.code, exc.details)
            epoch, new = self.membership.current_epoch(request.device_uuid, request.publisher_id)
            if new:
                self.events.emit(Kind.VERSION_EVENT_KIND_EPOCH_STARTED, epoch.number)
                log.info(
                    "epoch %d: %d worker(s): %s%s",
                    epoch.number,
                    len(epoch.members),
                    ", ".join(epoch.members),
                    f"; on the trainer's GPU (CUDA IPC): {', '.join(epoch.ipc_members)}"
                    if epoch.ipc_members
                    else "",
                )
            bucket_bytes = request.bucket_bytes or self.config.bucket_bytes
            to_workers = bool(epoch.members or epoch.ipc_members)
            record = self.registry.begin(request, bucket_bytes, epoch.number, to_workers)
            record.traceparent = tracing.current_traceparent()
            if self.config.delta_updates:
                self._plan_delta(record, epoch)
            if epoch.ipc_members:  # before answering: the trainer offers its buffer right after
                self.coordinator.expect_ipc(record.version, record.plan_bytes(), len(epoch.ipc_members))
            self._spawn(self.coordinator.distribute(record, epoch))
            log.info(
                "v%d published to epoch %d: %d tensors, %.1f MB",
                record.version,
                epoch.number,
                len(record.metas),
                record.layout.total_bytes / 1e6,
            )
            rdv = self.coordinator.rendezvous(epoch.group_name, epoch.secret, 0, len(epoch.members) + 1)
            return pb.PublishVersionResponse(plan=record.plan(rdv), ipc_workers=len(epoch.ipc_members))

    async def OfferIpcBuffer(self, request: pb.OfferIpcBufferRequest, context: grpc.aio.ServicerContext):
        handle = request.handle
        if not request.HasField("handle"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handle: required")
        problem = handle_problem(handle)
        if problem is None and not DEVICE_UUID.match(handle.device_uuid):
            problem = ("device_uuid", "a GPU UUID of 1-128 characters [A-Za-z0-9-]")
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"handle.{problem[0]}: {problem[1]}")
        if self.registry.get(request.version) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version: v{request.version} was not published")
        if handle.device_uuid != self.membership.epoch.trainer_device:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"handle.device_uuid: {handle.device_uuid} is not the GPU v{request.version} was published "
                f"from ({self.membership.epoch.trainer_device or 'CPU'})",
            )
        problem, waiting = self.coordinator.offer_ipc(request.version, handle)
        if problem:
            code = (
                grpc.StatusCode.INVALID_ARGUMENT
                if problem.startswith("handle")
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            await context.abort(code, problem)
        return pb.OfferIpcBufferResponse(ipc_workers=waiting)

    def _plan_delta(self, record: VersionRecord, epoch: Epoch) -> None:
        """Make `record` a delta against the previous version when every epoch member serves it
        (broadcast/delta.py); a version that changes every tensor stays whole."""
        previous = self.registry.get(record.version - 1)
        members = [self.membership.live.get(wid) for wid in epoch.members + epoch.ipc_members]
        base = delta.delta_base(
            previous.version if previous is not None else 0,
            previous is not None and reached(previous.state, pb.VERSION_STATE_COMMITTED),
            (w.weight_version if w is not None and w.verified else None for w in members),
        )
        if not base:
            return
        changed = delta.changed_tensors(previous.metas, record.metas)
        if changed and len(changed) < len(record.metas):
            record.set_delta(base, changed)
            sent = record.delta_bytes
            telemetry.DELTA_BYTES_SAVED.inc(record.layout.total_bytes - sent)
            log.info(
                "v%d is a delta against v%d: %d of %d tensors, %.1f of %.1f MB",
                record.version,
                base,
                len(changed),
                len(record.metas),
                sent / 1e6,
                record.layout.total_bytes / 1e6,
            )

    async def AwaitCatchUp(self, request: pb.AwaitCatchUpRequest, context: grpc.aio.ServicerContext):
        if request.have_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "have_version: must be >= 0")
        if not math.isfinite(request.timeout_s) or not 0 <= request.timeout_s <= MAX_WAIT_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be finite and in [0, {MAX_WAIT_S:.0f}]"
            )
        deadline = time.monotonic() + request.timeout_s
        while True:
            record = self.registry.get(request.have_version)
            if record is not None and request.have_version == self.registry.latest_committed:
                started = await self.coordinator.catch_up(record)
                if started is not None:
                    return pb.AwaitCatchUpResponse(plan=started[0], ipc_workers=started[1])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return pb.AwaitCatchUpResponse()
            await self.events.changed(min(remaining, 1.0))  # retry timers move without events

    async def WaitVersion(self, request: pb.WaitVersionRequest, context: grpc.aio.ServicerContext):
        if request.version < 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"version: must be >= 1 (got {request.version})"
            )
        if request.state == pb.VERSION_STATE_UNSPECIFIED or request.state not in pb.VersionState.values():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "state: must be a VersionState other than UNSPECIFIED"
            )
        if not math.isfinite(request.timeout_s) or not 0 <= request.timeout_s <= MAX_WAIT_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be finite and in [0, {MAX_WAIT_S:.0f}]"
            )
        deadline = time.monotonic() + request.timeout_s
        while True:
            record = self.registry.get(request.version)
            if record is not None:
                if reached(record.state, request.state):
                    return pb.WaitVersionResponse(version=record.info(), reached=True)
                if is_final_for(record.state, request.state):
                    return pb.WaitVersionResponse(version=record.info(), reached=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                info = record.info() if record is not None else pb.VersionInfo(version=request.version)
                return pb.WaitVersionResponse(version=info, reached=False)
            await self.events.changed(remaining)

    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext):
        try:
            worker = self.membership.register(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.details)
        self.events.emit(Kind.VERSION_EVENT_KIND_WORKER_JOINED, worker.claimed_version, worker.worker_id)
        self._changed()
        log.info(
            "worker %s joined at %s, says it serves v%d",
            worker.worker_id,
            worker.address,
            worker.claimed_version,
        )
        return pb.RegisterWorkerResponse(
            latest_version=self.registry.latest_committed,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
        )

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext):
        try:
            self.membership.heartbeat(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.details)
        return pb.HeartbeatResponse(latest_version=self.registry.latest_committed)

    async def UnregisterWorker(self, request: pb.UnregisterWorkerRequest, context: grpc.aio.ServicerContext):
        if not request.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: required")
        worker = self.membership.unregister(request.worker_id)
        if worker is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"worker_id: {quote(request.worker_id)} is not registered"
            )
        worker.state = WorkerState.WORKER_STATE_DROPPED
        self.events.emit(Kind.VERSION_EVENT_KIND_WORKER_DROPPED, worker.weight_version, worker.worker_id)
        self._changed()
        return pb.UnregisterWorkerResponse()

    async def GetStatus(
        self, request: pb.WeightBroadcastServiceGetStatusRequest, context: grpc.aio.ServicerContext
    ):
        workers = [w.info() for w in self.membership.live.values()]
        workers += [w.info() for w in self.membership.dropped.values()]
        return pb.WeightBroadcastServiceGetStatusResponse(
            latest_version=self.registry.latest_committed,
            versions=[r.info() for r in self.registry.records.values()],
            workers=workers,
            backend=self.config.backend,
            updates_failed_total=self.coordinator.failures_total,
            epoch=self.membership.epoch.number,
            epoch_members=list(self.membership.epoch.members),
        )

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchVersionsResponse]:
        if request.after_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "after_version: must be >= 0")
        known = set(pb.VersionEventKind.values()) - {Kind.VERSION_EVENT_KIND_UNSPECIFIED}
        unknown = sorted(set(request.kinds) - known)
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"kinds: unknown event kind(s) {unknown}; leave empty for all",
            )
        if request.after_seq < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "after_seq: must be >= 0")
        kinds = frozenset(request.kinds)
        if request.replay_only:
            for event in self.events.replay(request.after_version, kinds, request.after_seq):
                yield pb.WatchVersionsResponse(event=event)
            return
        async for event in self.events.follow(request.after_version, kinds, request.after_seq):
            yield pb.WatchVersionsResponse(event=event)
