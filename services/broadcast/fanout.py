"""Fan-out: bring every registered worker to the newest version, one update at a time per worker.

The protocol, as the service runs it (one driver task per worker; `v` is the trainer's version):

    trainer:    plan = PublishVersion(v, metas)            # validated before any byte moves
                TransferGroup.join(plan.rendezvous).send(tensors)   # its only cost; then trains on
    service:    recv v into buffer[v]; watermark advances per bucket; verify -> COMMITTED
    per worker: while worker.version < target():           # target = newest RECEIVING/COMMITTED
                    UpdateWeights(plan_w) || send(buffer[target], wait for watermark)
                    # worker: pause(keep) -> recv -> verify -> swap -> resume -> ack(APPLIED|FAILED)

Invariants:
- Serialised per worker: at most one update in flight to a worker; the next target is chosen only
  after the previous ack, so a worker never goes backwards and never applies a version twice. A newer
  version supersedes older ones that have not started for that worker.
- Isolation: each (service, worker) transfer is its own pairwise group (world size 2). A dead or slow
  worker fails only its own group, after `transfer_timeout_s`; the trainer and the other workers never
  wait for it. We chose pairwise groups over one group of all workers because a collective over N
  receivers stalls or breaks as a whole when one member dies, and membership changes would force
  regrouping; the cost is that the service sends the bytes N times, in parallel.
- Cut-through: a worker's transfer may start while the trainer's bytes are still arriving (the sender
  waits on the buffer watermark), so end-to-end time is close to one transfer, not two. Workers check
  every tensor's checksum against the trainer's metadata themselves, so nothing unverified is served.
- Every step has a deadline: rendezvous and each bucket (transfer_timeout_s), the UpdateWeights RPC
  (2 * transfer_timeout_s + rpc_margin_s). Failures are recorded on the worker, counted in
  parity_broadcast_update_failures_total{reason}, and emitted as WORKER_FAILED events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import grpc

from parity import tracing
from parity.config.broadcast import BroadcastConfig
from parity.server import bearer, channel
from parity.transport import TransferError, TransferGroup
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.broadcast import telemetry
from services.broadcast.events import Kind
from services.broadcast.membership import WorkerRecord, WorkerState
from services.broadcast.registry import VersionRecord, VersionRegistry

log = logging.getLogger(__name__)
SENDER_GRACE_S = 5.0


def pairwise_rendezvous(
    host: str, port: int, backend: str, group_name: str, timeout_s: float
) -> tuple[common_pb2.Rendezvous, common_pb2.Rendezvous]:
    """A group of two on the service's TCPStore at host:port: (the sender's side, rank 0; the
    receiver's side, rank 1). Every transfer the service takes part in is one of these."""
    receiver = common_pb2.Rendezvous(
        host=host,
        port=port,
        rank=1,
        world_size=2,
        backend=backend,
        group_name=group_name,
        timeout_s=timeout_s,
    )
    sender = common_pb2.Rendezvous()
    sender.CopyFrom(receiver)
    sender.rank = 0
    return sender, receiver


def _send_to_worker(
    rendezvous: common_pb2.Rendezvous, record: VersionRecord, buffer, timeout_s: float
) -> int:
    group = TransferGroup.join(rendezvous, host_store=True)
    try:
        return group.send_packed(
            buffer.tensor, record.bucket_bytes, ready=lambda end: buffer.wait_for(end, timeout_s)
        )
    finally:
        group.close()


def _failure_reason(error: str, code: grpc.StatusCode | None) -> str:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unreachable"
    if code is not None:
        return "rpc"
    return "checksum" if "checksum" in error.lower() else "transfer"


class FanOut:
    """Runs one driver task per worker; see the module docstring for the protocol."""

    def __init__(
        self,
        config: BroadcastConfig,
        registry: VersionRegistry,
        store_port: int,
        on_attempt_done: Callable[[], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.store_port = store_port
        self.on_attempt_done = on_attempt_done
        self.failures_total = 0

    def start(self, worker: WorkerRecord) -> None:
        worker.driver = asyncio.create_task(self._drive(worker), name=f"fanout-{worker.worker_id}")
        worker.kick.set()

    async def stop(self, worker: WorkerRecord) -> None:
        if worker.driver is not None and not worker.driver.done():
            worker.driver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker.driver

    async def _drive(self, worker: WorkerRecord) -> None:
        chan = channel(worker.address)
        stub = rollout_pb2_grpc.RolloutServiceStub(chan)
        try:
            while True:
                await worker.kick.wait()
                worker.kick.clear()
                while True:
                    target = self.registry.fanout_target()
                    if target is None or target.version <= worker.weight_version:
                        break
                    if (
                        worker.state == WorkerState.WORKER_STATE_FAILED
                        and target.version <= worker.attempted_version
                        and time.monotonic() - worker.last_failure_monotonic
                        < self.config.retry_failed_after_s
                    ):
                        break  # failed at this version already: wait for a newer one or the retry timer
                    try:
                        await self._update(worker, stub, target)
                    except Exception as exc:  # keep the driver alive: one bad attempt is one failure
                        log.exception("update of %s to v%d crashed", worker.worker_id, target.version)
                        worker.state = WorkerState.WORKER_STATE_FAILED
                        worker.last_error = f"internal: {exc!r}"
                        worker.updates_failed += 1
                        worker.attempted_version = max(worker.attempted_version, target.version)
                        worker.last_failure_monotonic = time.monotonic()
                        telemetry.FAILURES.labels("internal").inc()
                        self.on_attempt_done()
        finally:
            await chan.close()

    async def _update(
        self, worker: WorkerRecord, stub: rollout_pb2_grpc.RolloutServiceStub, record: VersionRecord
    ) -> None:
        buffer = record.buffer
        if buffer is None:
            return
        version = record.version
        record.started_workers.add(worker.worker_id)
        worker.state = WorkerState.WORKER_STATE_UPDATING
        timeout_s = self.config.transfer_timeout_s
        send_rdv, worker_rdv = pairwise_rendezvous(
            self.config.data_host,
            self.store_port,
            self.config.backend,
            f"v{version}-{worker.worker_id}-{uuid.uuid4().hex[:8]}",
            timeout_s,
        )
        plan = record.plan(worker_rdv)
        attrs = {
            "parity.weight_version": version,
            "parity.worker_id": worker.worker_id,
            "bytes": record.layout.total_bytes,
        }
        start = time.monotonic()
        error, code, reply = "", None, None
        with tracing.span("broadcast_transfer", attrs, kind="client", parent_traceparent=record.traceparent):
            buffer.leases += 1  # the registry reuses a retired buffer only with no lease on it
            sender = asyncio.ensure_future(
                asyncio.to_thread(_send_to_worker, send_rdv, record, buffer, timeout_s)
            )
            sender.add_done_callback(lambda _task: setattr(buffer, "leases", buffer.leases - 1))
            try:
                reply = await stub.UpdateWeights(
                    rollout_pb2.UpdateWeightsRequest(plan=plan),
                    timeout=2 * timeout_s + self.config.rpc_margin_s,
                    metadata=bearer(self.config.auth_token),
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                error = f"UpdateWeights: {code.name}: {exc.details()}"
            sent = 0
            try:
                grace = (
                    timeout_s
                    if reply is not None and reply.outcome == rollout_pb2.UPDATE_OUTCOME_APPLIED
                    else SENDER_GRACE_S
                )
                sent = await asyncio.wait_for(asyncio.shield(sender), grace)
            except (TransferError, RuntimeError) as exc:
                error = error or f"transfer: {exc}"
            except TimeoutError:  # the thread ends on its own collective timeout; don't wait for it
                error = error or "transfer: sender still running after the worker answered"
        elapsed = time.monotonic() - start
        if reply is not None and not error:
            error = self._check_reply(reply, record)
        worker.last_update_seconds = elapsed
        worker.last_paused_seconds = reply.paused_seconds if reply is not None else 0.0
        worker.attempted_version = max(worker.attempted_version, version)
        if sent:
            telemetry.BYTES.labels("sent").inc(sent)
        if not error:
            worker.weight_version = reply.weight_version
            worker.state = WorkerState.WORKER_STATE_SERVING
            worker.last_error = ""
            worker.updates_applied += 1
            telemetry.UPDATE_SECONDS.observe(elapsed)
            self.registry.events.emit(Kind.VERSION_EVENT_KIND_WORKER_UPDATED, version, worker.worker_id)
            log.info("worker %s now serves v%d (%.2fs)", worker.worker_id, version, elapsed)
        else:
            reason = _failure_reason(error, code)
            worker.state = WorkerState.WORKER_STATE_FAILED
            worker.last_error = error
            worker.updates_failed += 1
            worker.last_failure_monotonic = time.monotonic()
            self.failures_total += 1
            telemetry.FAILURES.labels(reason).inc()
            self.registry.events.emit(Kind.VERSION_EVENT_KIND_WORKER_FAILED, version, worker.worker_id, error)
            log.warning("update of %s to v%d failed (%s): %s", worker.worker_id, version, reason, error)
        self.on_attempt_done()

    @staticmethod
    def _check_reply(reply: rollout_pb2.UpdateWeightsResponse, record: VersionRecord) -> str:
        if reply.outcome == rollout_pb2.UPDATE_OUTCOME_FAILED:
            return reply.error or "worker reported FAILED without an error"
        if reply.outcome not in (
            rollout_pb2.UPDATE_OUTCOME_APPLIED,
            rollout_pb2.UPDATE_OUTCOME_ALREADY_CURRENT,
        ):
            return f"worker answered outcome {reply.outcome}"
        if reply.weight_version != record.version:
            return f"worker acked version {reply.weight_version}, expected {record.version}"
        if reply.checksums and list(reply.checksums) != [m.checksum for m in record.metas]:
            return "checksum: the worker's reported checksums differ from the trainer's"
        return ""
