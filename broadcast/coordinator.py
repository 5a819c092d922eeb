"""The coordinator: moves each version from the trainer to the workers of one epoch, without
touching a byte of it.

The protocol (`v` is the trainer's version, E the current membership epoch, N its workers):

    trainer:  plan = PublishVersion(v, metas)           # validated; names E's group, rank 0
              GroupHolder.use(plan.rendezvous).send(tensors)   # one bucketed broadcast to N ranks
              WaitVersion(v, DISTRIBUTED)               # reached, or FAILED with every error
    service:  for each worker w_i of E, concurrently: UpdateWeights(plan with rank i)
              # worker: recv into staging (its group held per epoch) + verify while generating
              #         -> pause -> swap -> resume -> ack APPLIED(checksums) | FAILED
              first verified ack -> COMMITTED; all acks -> DISTRIBUTED; none verified -> FAILED
    catch-up: a worker behind the trainer's snapshot (late joiner, failed update) gets it through a
              one-shot group of the trainer and the workers behind (AwaitCatchUp), never through E;
              one on the trainer's GPU by CUDA IPC of the snapshot, as below.
    same GPU: workers registered on the trainer's GPU are E's IPC members, never ranks of a group:
              PublishVersion answers ipc_workers > 0, the trainer packs the plan's tensors into one
              CUDA buffer and calls OfferIpcBuffer(v, handle); their UpdateWeights carries the
              handle (plan.cuda_ipc), waited for at most transfer_timeout_s.

Invariants:
- One transfer at a time (`lock`): a version or a catch-up, so ranks of a group never meet two
  collectives at once and a worker never goes backwards or applies a version twice.
- A worker's version is recorded only from an APPLIED ack whose checksums equal the trainer's.
- Any failure marks the epoch stale (groups are never reused after a failure) and the next version
  forms a new one; a worker that never reached the group's store, or could not be reached over gRPC,
  is excluded from epochs for `exclude_s`. Every RPC has a deadline of 2*transfer_timeout_s +
  rpc_margin_s and every collective `transfer_timeout_s`, so no version waits forever.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
import time
from collections.abc import Callable

import grpc

from broadcast import telemetry
from broadcast.events import Kind
from broadcast.membership import Epoch, Membership, WorkerRecord, WorkerState
from broadcast.registry import VersionRecord, VersionRegistry
from parity import tracing
from parity.config.broadcast import BroadcastConfig
from parity.server import bearer, channel
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from parity.weights.rendezvous import ONE_SHOT_PREFIX

log = logging.getLogger(__name__)


class Coordinator:
    """Distributes versions to epochs and catch-ups to late workers; see the module docstring."""

    def __init__(
        self,
        config: BroadcastConfig,
        registry: VersionRegistry,
        membership: Membership,
        store_port: int,
        on_change: Callable[[], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.membership = membership
        self.store_port = store_port
        self.on_change = on_change
        self.lock = asyncio.Lock()
        self.failures_total = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        # version -> (future of the trainer's CudaIpcHandle, bytes it must hold, workers waiting)
        self._ipc_offers: dict[int, tuple[asyncio.Future, int, int]] = {}

    # -- CUDA IPC (workers on the trainer's GPU) ------------------------------------------------
    def expect_ipc(self, version: int, nbytes: int, workers: int) -> asyncio.Future:
        """`version` goes to `workers` on the trainer's GPU: their updates wait for OfferIpcBuffer."""
        offer = asyncio.get_running_loop().create_future()
        self._ipc_offers[version] = (offer, nbytes, workers)
        return offer

    def offer_ipc(self, version: int, handle: common_pb2.CudaIpcHandle) -> tuple[str, int]:
        """Hand the trainer's handle to `version`'s IPC members: ("", how many wait for it), or
        (what is wrong, field first; 0)."""
        expected = self._ipc_offers.get(version)
        if expected is None or expected[0].done():
            problem = (
                f"version: no worker waits for a CUDA IPC buffer of v{version} (none on the trainer's "
                "GPU, already offered, or settled)"
            )
            return problem, 0
        if handle.nbytes != expected[1]:
            return (
                f"handle.nbytes: v{version}'s plan packs {expected[1]} bytes, the buffer has {handle.nbytes}",
                0,
            )
        expected[0].set_result(handle)
        return "", expected[2]

    def rendezvous(self, group_name: str, secret: str, rank: int, world_size: int) -> common_pb2.Rendezvous:
        return common_pb2.Rendezvous(
            host=self.config.data_host,
            port=self.store_port,
            rank=rank,
            world_size=world_size,
            backend=self.config.backend,
            group_name=group_name,
            timeout_s=self.config.transfer_timeout_s,
            secret=secret,
        )

    def _stub(self, worker: WorkerRecord) -> rollout_pb2_grpc.RolloutServiceStub:
        chan = self._channels.get(worker.address)
        if chan is None:
            chan = self._channels[worker.address] = channel(worker.address)
        return rollout_pb2_grpc.RolloutServiceStub(chan)

    async def close(self) -> None:
        for chan in self._channels.values():
            await chan.close()
        self._channels.clear()

    # -- versions -------------------------------------------------------------------------------
    async def distribute(self, record: VersionRecord, epoch: Epoch) -> None:
        """Send UpdateWeights for `record` to every worker of `epoch` and settle the version."""
        async with self.lock:
            start = time.monotonic()
            if not epoch.members and not epoch.ipc_members:
                self.registry.commit(record, 0.0)
                self.registry.distributed(record)
                return
            world = len(epoch.members) + 1
            offer = self._ipc_offers[record.version][0] if epoch.ipc_members else None  # see PublishVersion
            try:
                results = await asyncio.gather(
                    *(
                        self._update(worker_id, record, epoch.group_name, epoch.secret, rank, world, start)
                        for rank, worker_id in enumerate(epoch.members, 1)
                    ),
                    *(
                        self._update(wid, record, epoch.group_name, "", 0, 0, start, ipc=offer)
                        for wid in epoch.ipc_members
                    ),
                )
            finally:
                self._ipc_offers.pop(record.version, None)
            ids = epoch.members + epoch.ipc_members
            errors = [f"{wid}: {err}" for wid, err in zip(ids, results, strict=True) if err]
            if any(results[: len(epoch.members)]):
                self.membership.stale = True  # the group saw a failure: never reuse it
                await self._exclude_absent(epoch.group_name, epoch.members, world, results)
            if record.state == pb.VERSION_STATE_RECEIVING:  # no worker verified it
                self.registry.fail(record, "; ".join(errors)[:2000] or "no worker verified it")
            else:
                self.registry.distributed(record)
            self.on_change()

    async def _update(
        self,
        worker_id: str,
        record: VersionRecord,
        group_name: str,
        secret: str,
        rank: int,
        world: int,
        start: float,
        ipc: asyncio.Future | None = None,
    ) -> str:
        """One worker's UpdateWeights; returns "" when it applied and verified, else the error.
        With `ipc` (a worker on the trainer's GPU) the plan carries the trainer's CUDA IPC handle,
        once offered, instead of a rank of the group."""
        worker = self.membership.live.get(worker_id)
        if worker is None:
            return "left before the update"
        # an epoch's version may be a delta; a catch-up's group always carries the whole version
        whole = group_name.startswith(ONE_SHOT_PREFIX)
        worker.busy, worker.state = True, WorkerState.WORKER_STATE_UPDATING
        error, code, reply = "", None, None
        if ipc is None:
            plan = record.plan(self.rendezvous(group_name, secret, rank, world), whole=whole)
        else:
            plan = record.plan(None, whole=whole)
            try:  # the trainer packs and offers right after PublishVersion: bounded like a rendezvous
                handle = await asyncio.wait_for(asyncio.shield(ipc), self.config.transfer_timeout_s)
                plan.cuda_ipc.CopyFrom(handle)
            except TimeoutError:
                error = (
                    f"cuda_ipc: timed out after {self.config.transfer_timeout_s:g}s waiting for the "
                    f"trainer's CUDA IPC buffer of v{record.version} (OfferIpcBuffer)"
                )
        worker.attempted_version = max(worker.attempted_version, record.version)
        plan_bytes = record.plan_bytes(whole)
        attrs = {
            "parity.weight_version": record.version,
            "parity.worker_id": worker_id,
            "bytes": plan_bytes,
            "parity.base_version": plan.base_version,
            "parity.path": "cuda_ipc" if ipc is not None else "group",
        }
        with tracing.span("broadcast_transfer", attrs, kind="client", parent_traceparent=record.traceparent):
            try:
                if error:
                    raise _NotSent
                reply = await self._stub(worker).UpdateWeights(
                    rollout_pb2.UpdateWeightsRequest(plan=plan),
                    timeout=2 * self.config.transfer_timeout_s + self.config.rpc_margin_s,
                    metadata=bearer(self.config.auth_token),
                )
            except _NotSent:
                pass
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                error = f"UpdateWeights: {code.name}: {exc.details()}"
            except Exception as exc:  # keep the version's accounting whole
                error = f"internal: {exc!r}"
            if error:
                tracing.fail(error)
        elapsed = time.monotonic() - start
        worker.busy = False
        worker.last_update_seconds = elapsed
        worker.last_paused_seconds = reply.paused_seconds if reply is not None else None
        if reply is not None and not error:
            # the service's own check: the worker's checksums of what it received equal the trainer's
            with tracing.span("verify", attrs, parent_traceparent=record.traceparent):
                error = check_reply(reply, plan)
                if error:
                    tracing.fail(error)
        if not error:
            worker.weight_version, worker.verified = record.version, True
            if not group_name.startswith(ONE_SHOT_PREFIX):
                worker.epoch = self.membership.epoch.number
            worker.state, worker.last_error = WorkerState.WORKER_STATE_SERVING, ""
            worker.updates_applied += 1
            telemetry.UPDATE_SECONDS.observe(elapsed)
            telemetry.BYTES.labels("received").inc(plan_bytes)
            self.registry.commit(record, elapsed)
            self.registry.events.emit(Kind.VERSION_EVENT_KIND_WORKER_UPDATED, record.version, worker_id)
            log.info("worker %s verified and serves v%d (%.2fs)", worker_id, record.version, elapsed)
            return ""
        reason = _failure_reason(error, code)
        worker.state, worker.last_error = WorkerState.WORKER_STATE_FAILED, error
        worker.updates_failed += 1
        worker.last_failure_monotonic = time.monotonic()
        self.failures_total += 1
        telemetry.FAILURES.labels(reason).inc()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.membership.exclude(worker_id, error)
        self.registry.events.emit(Kind.VERSION_EVENT_KIND_WORKER_FAILED, record.version, worker_id, error)
        log.warning("update of %s to v%d failed (%s): %s", worker_id, record.version, reason, error)
        return error

    async def _exclude_absent(
        self, group_name: str, members: tuple[str, ...], world: int, results: list[str]
    ) -> None:
        """Exclude the workers that never reached the group's store (they broke it for everyone).

        When the store cannot tell (it did not answer), every member whose update failed
        (`results[i]` non-empty) is excluded instead: not knowing who broke the group must not
        mean that nobody did, or the same member would fail the next epoch too."""
        try:
            absent = await asyncio.to_thread(
                absent_ranks, self.config.data_host, self.store_port, group_name, world
            )
        except Exception as exc:  # torch raises RuntimeError/DistStoreError subclasses; we only log it
            failed = [wid for wid, err in zip(members, results, strict=False) if err]
            log.error(
                "group %s: the store could not say who joined (%s: %s); excluding the %d member(s) "
                "whose update failed for %.0fs: %s",
                group_name,
                type(exc).__name__,
                exc,
                len(failed),
                self.membership.exclude_s,
                ", ".join(failed),
            )
            for worker_id in failed:
                self.membership.exclude(
                    worker_id, f"update failed in group {group_name} (store unreadable: {exc})"
                )
            return
        for rank in absent:
            if rank >= 1:
                worker_id = members[rank - 1]
                log.warning("worker %s never joined group %s: excluded for %.0fs", worker_id, group_name,
                            self.membership.exclude_s)  # fmt: skip
                self.membership.exclude(worker_id, f"never joined the data group of epoch {group_name}")

    # -- catch-up -------------------------------------------------------------------------------
    def behind(self, version: int) -> list[WorkerRecord]:
        """Workers that should get `version` through a catch-up now."""
        now = time.monotonic()
        return [
            w
            for w in self.membership.eligible()
            if not w.busy
            and w.known_version < version
            and (
                w.state != WorkerState.WORKER_STATE_FAILED
                or now - w.last_failure_monotonic >= self.config.retry_failed_after_s
            )
        ]

    async def catch_up(self, record: VersionRecord) -> tuple[common_pb2.TransferPlan, int] | None:
        """If workers are behind `record`, start their catch-up and return the trainer's plan and
        how many of them are on its GPU (they take the snapshot by CUDA IPC: OfferIpcBuffer)."""
        if self.lock.locked():
            return None
        await self.lock.acquire()
        workers = self.behind(record.version)
        if not workers:
            self.lock.release()
            return None
        name = f"{ONE_SHOT_PREFIX}v{record.version}-{secrets.token_hex(4)}"
        secret = secrets.token_hex(16)
        gpu = self.membership.epoch.trainer_device
        ipc_ids = tuple(w.worker_id for w in workers if gpu and w.device_uuid == gpu)
        ids = tuple(w.worker_id for w in workers if w.worker_id not in ipc_ids)
        world = len(ids) + 1
        offer = (
            self.expect_ipc(record.version, record.plan_bytes(whole=True), len(ipc_ids)) if ipc_ids else None
        )
        log.info("catch-up of %s to v%d", ", ".join(ids + ipc_ids), record.version)

        async def run() -> None:
            try:
                start = time.monotonic()
                results = await asyncio.gather(
                    *(
                        self._update(wid, record, name, secret, r, world, start)
                        for r, wid in enumerate(ids, 1)
                    ),
                    *(self._update(wid, record, name, "", 0, 0, start, ipc=offer) for wid in ipc_ids),
                )
                if any(results[: len(ids)]):
                    await self._exclude_absent(name, ids, world, results)
                self.on_change()
            finally:
                self._ipc_offers.pop(record.version, None)
                self.lock.release()

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return record.plan(self.rendezvous(name, secret, 0, world), whole=True), len(ipc_ids)


class _NotSent(Exception):
    """The update failed before its RPC (no IPC handle came): the error is already set."""


def absent_ranks(host: str, port: int, group_name: str, world: int, timeout_s: float = 5.0) -> list[int]:
    """Ranks of `group_name` that never wrote their join key to the store (blocking)."""
    import torch.distributed as dist

    client = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"parity/{group_name}/", client)
    return [r for r in range(world) if not store.check([f"joined/{r}"])]


def check_reply(reply: rollout_pb2.UpdateWeightsResponse, plan: common_pb2.TransferPlan) -> str:
    """ "" when the ack proves the worker verified and applied `plan` (every tensor it sent, the
    changed ones of a delta), else what is wrong."""
    if reply.outcome == rollout_pb2.UPDATE_OUTCOME_FAILED:
        return reply.error or "worker reported FAILED without an error"
    if reply.outcome != rollout_pb2.UPDATE_OUTCOME_APPLIED:
        return f"worker answered outcome {rollout_pb2.UpdateOutcome.Name(reply.outcome)}, not APPLIED"
    if reply.weight_version != plan.version:
        return f"worker acked version {reply.weight_version}, expected {plan.version}"
    if list(reply.checksums) != [m.checksum for m in plan.tensors]:
        return "checksum: the worker's reported checksums differ from the trainer's"
    return ""


def _failure_reason(error: str, code: grpc.StatusCode | None) -> str:
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unreachable"
    if (
        code == grpc.StatusCode.DEADLINE_EXCEEDED
        or "timed out" in error.lower()
        or "timeout" in error.lower()
    ):
        return "timeout"
    if code is not None:
        return "rpc"
    if "checksum" in error:
        return "checksum"
    if "transfer" in error:
        return "transfer"
    return "internal"
