"""Publishing weight versions: the trainer is rank 0 of the epoch's data group.

The order of one publish:

    plan = broadcast.PublishVersion(version=v, tensors=describe(named), WSUM64, bucket_bytes)
    GroupHolder.use(plan.rendezvous).send(tensors in plan order)   # straight to the workers
    broadcast.WaitVersion(v, DISTRIBUTED)     # every worker acked; FAILED if none verified it
    trainer.version = v                       # only now: a failed publish leaves it unchanged

The data group is held for the whole membership epoch (one rendezvous per epoch, not per version);
the service names a new group when membership changes or a transfer fails, and the holder then
tears the old one down and joins the new. A failed send waits until the service has settled the
version (FAILED), so the caller may publish the same number again at once.

Restarts: each Publisher has its own `publisher_id` (a random UUID), sent with every
PublishVersion. The service starts a new epoch for a new publisher, so a restarted trainer joins a
fresh group with the workers instead of the one its dead predecessor held (which it would wait on
until the rendezvous timed out).

Catch-up: after each publish the trainer keeps a host copy of the version it sent (the snapshot)
and a background thread long-polls `AwaitCatchUp`. A worker that joined late, or whose update
failed, gets the snapshot through a one-shot group of the trainer and the workers behind; the epoch
group and the training loop are not involved. A trainer restarted at the broadcast's latest version
serves that version from the start (`serve_catch_up`), before it has published anything.

Same GPU: workers registered on the trainer's GPU are never ranks of a group (NCCL refuses two ranks
on one GPU). When PublishVersion (or AwaitCatchUp) answers `ipc_workers > 0`, the trainer packs the
plan's tensors into one buffer on its GPU and hands its CUDA IPC handle over with OfferIpcBuffer;
those workers map and copy it. The buffer is kept until they are done (the version settled, or no
worker is updating any more).

Versions: v = previous + 1, starting above max(checkpoint's published version, the broadcast's
latest) so that a trainer restarted from an older checkpoint never reuses a version number. With
no broadcast address configured, versions are still numbered (local mode, for trainer-only runs).

Model-free: the caller hands over named tensors (the trainer: its parameters by name, on device,
tied weights once, as vLLM loads them); nothing here knows what a model is.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from parity import tracing
from parity.server import CHANNEL_OPTIONS, bearer
from parity.v1 import broadcast_pb2, broadcast_pb2_grpc, common_pb2
from parity.weights.checksum import describe
from parity.weights.cuda_ipc import export_buffer
from parity.weights.devices import cuda_device_uuid
from parity.weights.group import GroupHolder
from parity.weights.layout import DEFAULT_BUCKET_BYTES, Layout, TransferError, pack
from parity.weights.wire import TransferGroup

if TYPE_CHECKING:
    import torch

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]

log = logging.getLogger(__name__)

CLOSE_JOIN_S = 10.0  # close(): how long to wait for a catch-up being sent
CATCH_UP_POLL_S = 5.0
PUBLISH_BACKOFF_CAP_S = 30.0


class PublishError(RuntimeError):
    """The broadcast service refused or failed a version; the trainer's version is unchanged."""


@dataclass
class PublishResult:
    version: int
    bytes_sent: int
    seconds: float
    committed: bool


@dataclass(frozen=True)
class Snapshot:
    """A version the trainer can still send: host copies in plan order, or (with a `snapshots`
    source) only the names, the tensors then read from the source when a catch-up needs them."""

    version: int
    tensors: tuple
    names: tuple = ()


class Publisher:
    """Publishes named tensors as consecutive versions (see the module docstring)."""

    def __init__(
        self,
        broadcast_address: str,
        model_name: str,
        auth_token: str = "",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        wait_committed_s: float = 30.0,
        rpc_timeout_s: float = 60.0,
        keep_snapshot: bool = True,
        snapshots: Callable[[int, Sequence[str]], Sequence | None] | None = None,
    ) -> None:
        """`snapshots(version, names)`: the caller's host copies of a committed version in `names`
        order (None once it no longer holds it). Given, the sender copies nothing itself (the
        trainer passes its weight history); else it keeps a host copy of the newest version."""
        self.address = broadcast_address
        self.model_name = model_name
        self.metadata = bearer(auth_token)
        self.bucket_bytes = bucket_bytes
        self.wait_committed_s = wait_committed_s
        self.rpc_timeout_s = rpc_timeout_s
        self.keep_snapshot = keep_snapshot
        self._snapshots = snapshots
        self.publisher_id = uuid.uuid4().hex  # new per process: a restart starts a new epoch
        self._channel = (
            tracing.instrument_channel(grpc.insecure_channel(broadcast_address, options=CHANNEL_OPTIONS))
            if broadcast_address
            else None
        )
        self._stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self._channel) if self._channel else None
        self._holder = GroupHolder()
        self._snapshot = Snapshot(0, ())
        self._closed = threading.Event()
        self._catch_up_thread: threading.Thread | None = None
        self.catch_up_failures = 0  # catch-ups that raised (a TransferError is only logged)
        self.catch_ups_sent = 0
        self.publish_retries_total = 0
        self.delta_bytes_saved = 0  # bytes delta updates did not send (broadcast.delta_updates)
        self._gpu: tuple[object, str] | None = None  # (device, UUID) of the last CUDA publish, for IPC

    def latest_version(self) -> int:
        """The broadcast service's latest version (0 in local mode)."""
        if self._stub is None:
            return 0
        reply = self._stub.GetStatus(
            broadcast_pb2.WeightBroadcastServiceGetStatusRequest(),
            timeout=self.rpc_timeout_s,
            metadata=self.metadata,
            wait_for_ready=True,  # the launcher may start us a moment before the broadcast serves
        )
        return int(reply.latest_version)

    def wait_workers_at(
        self, version: int, workers: int, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> int:
        """Wait until `workers` registered workers hold `version` or a later one, the catch-up
        thread serving the ones behind meanwhile; give up after `timeout_s` or once `stop()`.
        Returns how many held it when the wait ended (0 at once in local mode)."""
        if self._stub is None or workers <= 0:
            return 0
        deadline = time.monotonic() + timeout_s
        held = 0
        while True:
            try:
                reply = self._stub.GetStatus(
                    broadcast_pb2.WeightBroadcastServiceGetStatusRequest(),
                    timeout=min(self.rpc_timeout_s, 10.0),
                    metadata=self.metadata,
                )
                held = sum(
                    w.weight_version >= version and w.state != broadcast_pb2.WORKER_STATE_DROPPED
                    for w in reply.workers
                )
            except grpc.RpcError as exc:  # a broadcast restarting: ask again until the deadline
                log.warning("GetStatus while waiting for workers at v%d: %s", version, exc.code().name)
            if held >= workers or time.monotonic() >= deadline or stop():
                return held
            time.sleep(0.25)

    def publish_retrying(
        self,
        named_tensors: Callable[[], NamedTensors],
        version: int,
        attempts: int,
        backoff_s: float,
        links_from: Sequence[str] = (),
    ) -> PublishResult:
        """`publish_tensors(named_tensors(), ...)`, retried after a failure (a transfer that failed,
        a broadcast service that did not answer): waits `backoff_s`, doubling up to
        PUBLISH_BACKOFF_CAP_S, at most `attempts` tries in all; then PublishError naming every
        attempt. `named_tensors` is called once per attempt and returns the on-device (name, tensor)
        pairs to send (all of them: checksums need every tensor before PublishVersion). A retry
        publishes the number again unless the broadcast service already holds it (a failed version
        is published again)."""
        errors: list[str] = []
        delay_s = backoff_s
        for attempt in range(1, attempts + 1):
            try:
                result = self.publish_tensors(named_tensors(), version, links_from)
            except PublishError as exc:
                errors.append(f"attempt {attempt}: {exc}")
                self.publish_retries_total += int(attempt < attempts)
                if attempt == attempts:
                    break
                log.warning(
                    "publish of version %d failed (attempt %d of %d): %s; retrying in %.1fs",
                    version,
                    attempt,
                    attempts,
                    exc,
                    delay_s,
                )
                time.sleep(delay_s)
                delay_s = min(PUBLISH_BACKOFF_CAP_S, 2 * delay_s)
                try:
                    version = max(version, self.latest_version() + 1)
                except grpc.RpcError as rpc:  # the service is down: the next attempt reports it
                    log.warning("GetStatus before retrying: %s", rpc.code().name)
                continue
            if attempt > 1:
                log.info("version %d published on attempt %d", result.version, attempt)
            return result
        raise PublishError(f"gave up after {attempts} attempt(s): " + "; ".join(errors))

    def publish_tensors(
        self, named: NamedTensors, version: int, links_from: Sequence[str] = ()
    ) -> PublishResult:
        """Send `named` tensors (CPU or CUDA) as `version`; raise PublishError (version unchanged)
        on failure. `links_from`: traceparents of the train_step spans this version contains (span
        links)."""
        start = time.perf_counter()
        attrs = {tracing.ATTR_WEIGHT_VERSION: version}
        with tracing.span("publish_version", attrs, links_from=links_from) as span:
            if self._stub is None:
                return PublishResult(version, 0, time.perf_counter() - start, committed=True)
            metas = describe(named)
            device_uuid = _device_uuid(named)
            request = broadcast_pb2.PublishVersionRequest(
                version=version,
                model=self.model_name,
                tensors=metas,
                checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
                bucket_bytes=self.bucket_bytes,
                device_uuid=device_uuid,
                publisher_id=self.publisher_id,
            )
            try:
                reply = self._stub.PublishVersion(
                    request,
                    timeout=self.rpc_timeout_s,
                    metadata=self.metadata,
                    wait_for_ready=True,  # a broadcast service that is restarting is waited for
                )
            except grpc.RpcError as exc:
                raise PublishError(f"PublishVersion({version}): {exc.code().name}: {exc.details()}") from exc
            plan = reply.plan
            by_name = dict(named)
            try:
                ordered = [by_name[meta.name] for meta in plan.tensors]
            except KeyError as exc:
                raise PublishError(f"plan names tensor {exc} that the trainer does not have") from None
            sent = 0
            # workers on this GPU map one packed copy (kept until the version settles), never a rank
            self._note_gpu(named, device_uuid)
            ipc_buffer = self._offer_ipc(version, plan, ordered) if reply.ipc_workers else None
            if plan.rendezvous.world_size > 1:  # else: no worker in the epoch, nothing to send
                try:
                    with self._holder.use(plan.rendezvous) as group:
                        sent = group.send(ordered, int(plan.bucket_bytes) or self.bucket_bytes)
                except TransferError as exc:
                    self._wait_final(version, plan)  # settle it, so the number may be published again
                    raise PublishError(f"transfer of version {version}: {exc}") from exc
            info = self._wait_final(version, plan)
            del ipc_buffer  # settled: every worker on this GPU copied it out (or failed)
            if info is not None and info.state == broadcast_pb2.VERSION_STATE_FAILED:
                raise PublishError(f"version {version} failed: {info.error}")
            committed = info is not None and info.state in (
                broadcast_pb2.VERSION_STATE_COMMITTED,
                broadcast_pb2.VERSION_STATE_DISTRIBUTED,
            )
            if committed and self.keep_snapshot:  # the whole version, also after a delta
                self._keep(version, tuple(meta.name for meta in metas), by_name)
            seconds = time.perf_counter() - start
            span.set_attribute(tracing.ATTR_BYTES, sent)
            span.set_attribute("parity.committed", committed)
            if plan.base_version:
                self.delta_bytes_saved += int(plan.full_bytes) - sent
                log.info(
                    "published version %d: %.1f MB in %.2fs (a delta against v%d: %d of %d tensors, "
                    "%.1f MB not sent)",
                    version,
                    sent / 1e6,
                    seconds,
                    plan.base_version,
                    len(plan.tensors),
                    len(metas),
                    (int(plan.full_bytes) - sent) / 1e6,
                )
            else:
                log.info("published version %d: %.1f MB in %.2fs", version, sent / 1e6, seconds)
            return PublishResult(version, sent, seconds, committed)

    def _offer_ipc(self, version: int, plan: common_pb2.TransferPlan, ordered: Sequence):
        """Pack the plan's tensors into one CUDA buffer on the trainer's GPU and hand its IPC handle
        to the broadcast service for the workers on this GPU; the buffer (to keep until they copied
        it), or None when that failed (those workers then fail this version, the group's do not)."""
        import torch

        if self._gpu is None:
            log.warning("version %d: workers on the trainer's GPU, but it published no CUDA tensors", version)
            return None
        device, device_uuid = self._gpu
        try:
            buffer = pack(ordered, Layout.of(plan.tensors), device=str(device))
            torch.cuda.synchronize(buffer.device)
            handle = export_buffer(buffer, device_uuid, float(plan.rendezvous.timeout_s))
            self._stub.OfferIpcBuffer(
                broadcast_pb2.OfferIpcBufferRequest(version=version, handle=handle),
                timeout=self.rpc_timeout_s,
                metadata=self.metadata,
            )
        except (grpc.RpcError, RuntimeError, ValueError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
            log.warning(
                "CUDA IPC offer of version %d failed (%s): workers on this GPU miss it", version, detail
            )
            return None
        log.info("version %d: %.1f MB offered by CUDA IPC to %s", version, buffer.numel() / 1e6, device_uuid)
        return buffer

    def _wait_final(self, version: int, plan: common_pb2.TransferPlan) -> broadcast_pb2.VersionInfo | None:
        """Wait until every worker of the epoch acked `version` (DISTRIBUTED) or it FAILED; None
        when waiting is off (wait_committed_s <= 0)."""
        if self.wait_committed_s <= 0 or self._stub is None:
            return None
        # a version settles within its workers' RPC deadline: rendezvous + transfer, then the acks
        wait_s = self.wait_committed_s + 2 * float(plan.rendezvous.timeout_s)
        try:
            reply = self._stub.WaitVersion(
                broadcast_pb2.WaitVersionRequest(
                    version=version, state=broadcast_pb2.VERSION_STATE_DISTRIBUTED, timeout_s=wait_s
                ),
                timeout=wait_s + 10,
                metadata=self.metadata,
            )
        except grpc.RpcError as exc:
            raise PublishError(f"WaitVersion({version}): {exc.code().name}: {exc.details()}") from exc
        if reply.version.state == broadcast_pb2.VERSION_STATE_RECEIVING:
            raise PublishError(f"version {version} not settled within {wait_s:.0f}s")
        return reply.version

    # -- catch-up -------------------------------------------------------------------------------
    def serve_catch_up(self, version: int, named: NamedTensors) -> None:
        """Serve catch-ups of `version`, committed before this publisher existed: a trainer restarted
        at the broadcast's latest version publishes nothing until it has trained a step, and a worker
        behind (a rollout service restarted meanwhile) generates nothing until it is caught up, so
        without this neither would ever move. `named` are that version's tensors (with a `snapshots`
        source, only their names are kept)."""
        if self._stub is not None and version > 0:
            # A restarted trainer publishes nothing before its first step: its GPU comes from here,
            # for a catch-up of workers on it (by CUDA IPC, like a publish).
            self._note_gpu(named, _device_uuid(named))
            self._keep(version, tuple(name for name, _ in named), dict(named))

    def _note_gpu(self, named: NamedTensors, device_uuid: str) -> None:
        """Remember the GPU of CUDA tensors (`device_uuid` non-empty) for IPC offers."""
        if device_uuid:
            self._gpu = (named[0][1].device, device_uuid)

    def _keep(self, version: int, names: tuple, by_name: dict) -> None:
        if self._snapshots is not None:
            snapshot = Snapshot(version, (), names)
        else:
            snapshot = Snapshot(
                version, tuple(by_name[n].detach().to("cpu", copy=True) for n in names), names
            )
        self._snapshot = snapshot  # replaced whole: a catch-up holds the old one
        if self._catch_up_thread is None or not self._catch_up_thread.is_alive():
            self._catch_up_thread = threading.Thread(target=self._catch_up_loop, name="catch-up", daemon=True)
            self._catch_up_thread.start()

    def _catch_up_loop(self) -> None:
        while not self._closed.is_set():
            snapshot = self._snapshot
            try:
                reply = self._stub.AwaitCatchUp(
                    broadcast_pb2.AwaitCatchUpRequest(
                        have_version=snapshot.version, timeout_s=CATCH_UP_POLL_S
                    ),
                    timeout=CATCH_UP_POLL_S + 10,
                    metadata=self.metadata,
                )
            except ValueError:  # the channel was closed between the loop's check and the call
                if self._closed.is_set():
                    return
                raise
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                log.warning("AwaitCatchUp: %s", exc.code().name)
                self._closed.wait(1.0)
                continue
            if not reply.HasField("plan"):
                continue
            try:
                self._send_catch_up(reply.plan, snapshot, reply.ipc_workers)
            except Exception:  # an OOM staging it, a CUDA error: the next catch-up may succeed
                log.exception("catch-up of v%d failed; catch-ups go on", reply.plan.version)
                self.catch_up_failures += 1
                self._closed.wait(1.0)

    def _send_catch_up(self, plan: common_pb2.TransferPlan, snapshot: Snapshot, ipc_workers: int = 0) -> None:
        if plan.version != snapshot.version:  # cannot happen: the service asks for what we hold
            log.error("catch-up asks for v%d, the trainer holds v%d", plan.version, snapshot.version)
            return
        tensors = snapshot.tensors
        if not tensors and self._snapshots is not None:
            tensors = tuple(self._snapshots(snapshot.version, snapshot.names) or ())
        if not tensors:
            log.error("catch-up of v%d: the trainer no longer holds that version; not sent", plan.version)
            return
        if plan.base_version or len(plan.tensors) != len(tensors):  # catch-ups are whole
            log.error("catch-up plan for v%d is not the whole version; not sent", plan.version)
            return
        start = time.perf_counter()
        # workers on this GPU map the snapshot, packed onto it, by CUDA IPC; the others join the group
        ipc_buffer = self._offer_ipc(plan.version, plan, tensors) if ipc_workers else None
        sent = 0
        try:
            if plan.rendezvous.world_size > 1:
                group = TransferGroup.join(plan.rendezvous)
                try:
                    sent = group.send(list(tensors), int(plan.bucket_bytes) or self.bucket_bytes)
                finally:
                    group.close()
        except TransferError as exc:
            log.warning("catch-up of v%d failed: %s", plan.version, exc)
            return
        finally:
            if ipc_buffer is not None:
                self._until_copied(float(plan.rendezvous.timeout_s))
                del ipc_buffer
        self.catch_ups_sent += 1
        log.info(
            "catch-up: v%d to %d worker(s) by the group (%.1f MB) and %d by CUDA IPC in %.2fs",
            plan.version,
            plan.rendezvous.world_size - 1,
            sent / 1e6,
            ipc_workers,
            time.perf_counter() - start,
        )

    def _until_copied(self, timeout_s: float) -> None:
        """Wait until no worker is updating (the catch-up's IPC workers copied the buffer out and
        acked, or failed), at most as long as their updates may take."""
        deadline = time.monotonic() + 2 * timeout_s + 30
        while time.monotonic() < deadline and not self._closed.is_set():
            try:
                status = self._stub.GetStatus(
                    broadcast_pb2.WeightBroadcastServiceGetStatusRequest(), timeout=self.rpc_timeout_s
                )
            except grpc.RpcError as exc:
                log.warning("GetStatus while a catch-up's IPC buffer is mapped: %s", exc.code().name)
            else:
                if not any(w.state == broadcast_pb2.WORKER_STATE_UPDATING for w in status.workers):
                    return
            self._closed.wait(0.2)

    def close(self) -> None:
        """Stop serving catch-ups and release the data group and the channel. Waits up to
        CLOSE_JOIN_S for the catch-up thread (closing the channel cancels its long poll; a catch-up
        being sent finishes or fails first), so no thread of ours is left inside gRPC or gloo."""
        self._closed.set()
        if self._channel is not None:
            self._channel.close()
        thread = self._catch_up_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_JOIN_S)
            if thread.is_alive():
                log.warning(
                    "the catch-up thread is still sending after %.0fs; closing without it", CLOSE_JOIN_S
                )
        self._holder.close()


def _device_uuid(named: NamedTensors) -> str:
    """The GPU the tensors are on ("" for CPU tensors): the broadcast service keeps workers on the
    same GPU out of the data group and hands them the version by CUDA IPC."""
    tensor = named[0][1] if named else None
    if tensor is None or not getattr(tensor, "is_cuda", False):
        return ""
    return cuda_device_uuid(tensor.device)
