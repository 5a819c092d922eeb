"""`parity.v1.WeightBroadcastService`: the gRPC face of registry, membership and fan-out.

Invariants:
- Every RPC validates its input first and answers INVALID_ARGUMENT / FAILED_PRECONDITION /
  RESOURCE_EXHAUSTED with details naming the field; a bad request never changes state.
- PublishVersion returns as soon as the plan exists: the service receives in the background, so the
  trainer's cost is its own send. It never waits for workers.
- State is mutated only on the event loop; blocking transfers run in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from parity import tracing
from parity.config.broadcast import BroadcastConfig
from parity.errors import RequestError
from parity.transport import TransferError
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2
from services.broadcast import telemetry
from services.broadcast.events import EventLog, Kind
from services.broadcast.fanout import FanOut, pairwise_rendezvous
from services.broadcast.ingest import receive_and_verify
from services.broadcast.membership import Membership, WorkerState
from services.broadcast.registry import VersionRegistry, is_final_for, reached

log = logging.getLogger(__name__)
SERVICE = "parity.v1.WeightBroadcastService"
# Joining the data plane or changing the version needs the token (when one is configured).
PROTECTED_METHODS = tuple(f"/{SERVICE}/{m}" for m in ("PublishVersion", "RegisterWorker", "UnregisterWorker"))
MAX_WAIT_S = 3600.0


class WeightBroadcastService(broadcast_pb2_grpc.WeightBroadcastServiceServicer):
    def __init__(self, config: BroadcastConfig, store_port: int) -> None:
        self.config = config
        self.store_port = store_port
        self.events = EventLog()
        self.registry = VersionRegistry(self.events, config.history_versions, config.max_version_bytes)
        self.membership = Membership(config.max_workers, config.heartbeat_timeout_s)
        self.fanout = FanOut(config, self.registry, store_port, self._after_attempt)
        self._tasks: set[asyncio.Task] = set()

    # -- background -----------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _after_attempt(self) -> None:
        self.registry.update_distributed(self.membership.attempted_versions())

    def _kick_all(self) -> None:
        for worker in self.membership.live.values():
            worker.kick.set()

    async def reap_forever(self) -> None:
        """Drop silent workers; re-kick failed ones once their retry delay has passed."""
        period = min(1.0, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            for worker in self.membership.expired():
                log.warning(
                    "worker %s dropped: no heartbeat for %.0fs",
                    worker.worker_id,
                    self.config.heartbeat_timeout_s,
                )
                await self.fanout.stop(worker)
                self.events.emit(
                    Kind.VERSION_EVENT_KIND_WORKER_DROPPED, worker.weight_version, worker.worker_id
                )
                self._after_attempt()
            telemetry.WORKERS.set(len(self.membership.live))
            now = time.monotonic()
            for worker in self.membership.live.values():
                if (
                    worker.state == WorkerState.WORKER_STATE_FAILED
                    and now - worker.last_failure_monotonic >= self.config.retry_failed_after_s
                ):
                    worker.kick.set()

    async def close(self) -> None:
        for worker in list(self.membership.live.values()):
            await self.fanout.stop(worker)
        for task in list(self._tasks):
            task.cancel()

    async def _ingest(self, rendezvous: common_pb2.Rendezvous, record) -> None:
        try:
            receive_s, _verify_s, bad = await asyncio.to_thread(receive_and_verify, rendezvous, record)
        except TransferError as exc:
            telemetry.FAILURES.labels("trainer_transfer").inc()
            self.registry.fail(record, f"transfer from trainer: {exc}")
            return
        if bad:
            telemetry.FAILURES.labels("trainer_checksum").inc()
            self.registry.fail(record, f"checksum mismatch on {len(bad)} tensor(s): {', '.join(bad[:5])}")
            return
        telemetry.BYTES.labels("received").inc(record.layout.total_bytes)
        self.registry.commit(record, receive_s)
        telemetry.LATEST_VERSION.set(self.registry.latest_committed)
        self._after_attempt()
        self._kick_all()

    # -- RPCs -----------------------------------------------------------------------------------
    async def PublishVersion(self, request: pb.PublishVersionRequest, context: grpc.aio.ServicerContext):
        attrs = {"parity.weight_version": request.version, "parity.model": request.model}
        with tracing.span("publish_version", attrs, kind="server"):
            try:
                self.registry.validate(request)
            except RequestError as exc:
                await context.abort(exc.code, exc.details)
            bucket_bytes = request.bucket_bytes or self.config.bucket_bytes
            record = self.registry.begin(request, bucket_bytes, self.config.device)
            record.traceparent = tracing.current_traceparent()
            trainer_rdv, rendezvous = pairwise_rendezvous(
                self.config.data_host,
                self.store_port,
                self.config.backend,
                f"publish-v{record.version}-{uuid.uuid4().hex[:8]}",
                self.config.transfer_timeout_s,
            )
            self._spawn(self._ingest(rendezvous, record))
            self._kick_all()  # cut-through: workers may start while the trainer sends
            log.info(
                "v%d published: %d tensors, %.1f MB",
                record.version,
                len(record.metas),
                record.layout.total_bytes / 1e6,
            )
            return pb.PublishVersionResponse(plan=record.plan(trainer_rdv))

    async def WaitVersion(self, request: pb.WaitVersionRequest, context: grpc.aio.ServicerContext):
        if request.version < 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"version: must be >= 1 (got {request.version})"
            )
        if request.state == pb.VERSION_STATE_UNSPECIFIED or request.state not in pb.VersionState.values():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "state: must be a VersionState other than UNSPECIFIED"
            )
        if not 0 <= request.timeout_s <= MAX_WAIT_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be in [0, {MAX_WAIT_S:.0f}]"
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
            worker, previous = self.membership.register(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.details)
        if previous is not None:
            await self.fanout.stop(previous)
        self.fanout.start(worker)
        self.events.emit(Kind.VERSION_EVENT_KIND_WORKER_JOINED, worker.weight_version, worker.worker_id)
        telemetry.WORKERS.set(len(self.membership.live))
        log.info(
            "worker %s joined at %s serving v%d", worker.worker_id, worker.address, worker.weight_version
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
                grpc.StatusCode.FAILED_PRECONDITION, f"worker_id: {request.worker_id!r} is not registered"
            )
        await self.fanout.stop(worker)
        self.events.emit(Kind.VERSION_EVENT_KIND_WORKER_DROPPED, worker.weight_version, worker.worker_id)
        self._after_attempt()
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
            updates_failed_total=self.fanout.failures_total,
        )

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchVersionsResponse]:
        if request.after_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "after_version: must be >= 0")
        async for event in self.events.follow(request.after_version):
            yield pb.WatchVersionsResponse(event=event)
