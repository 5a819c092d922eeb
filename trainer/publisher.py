"""Publishing weight versions to the weight-broadcast service.

The order of one publish (the trainer never waits for the fan-out to rollout workers):

    plan = broadcast.PublishVersion(version=v, tensors=describe(params), WSUM64, bucket_bytes)
    TransferGroup.join(plan.rendezvous).send(params in plan.tensors order, plan.bucket_bytes)
    broadcast.WaitVersion(v, COMMITTED)          # received + checksums verified (optional)
    trainer.version = v                          # only now: a failed publish leaves it unchanged

Versions: v = previous + 1, starting above max(checkpoint's published version, the broadcast's
latest) so that a trainer restarted from an older checkpoint never reuses a version number. With
no broadcast address configured, versions are still numbered (local mode, for trainer-only runs).
The tensors are the model's parameters by name (tied weights appear once, as vLLM loads them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from parity import tracing
from parity.server import bearer
from parity.transport import DEFAULT_BUCKET_BYTES
from parity.v1 import broadcast_pb2, broadcast_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class PublishError(RuntimeError):
    """The broadcast service refused or failed a version; the trainer's version is unchanged."""


@dataclass
class PublishResult:
    version: int
    bytes_sent: int
    seconds: float
    committed: bool


class Publisher:
    """Publishes the model's parameters as consecutive versions."""

    def __init__(
        self,
        broadcast_address: str,
        model_name: str,
        auth_token: str = "",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        wait_committed_s: float = 30.0,
        rpc_timeout_s: float = 60.0,
    ) -> None:
        self.address = broadcast_address
        self.model_name = model_name
        self.metadata = bearer(auth_token)
        self.bucket_bytes = bucket_bytes
        self.wait_committed_s = wait_committed_s
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = (
            tracing.instrument_channel(grpc.insecure_channel(broadcast_address, options=GRPC_OPTIONS))
            if broadcast_address
            else None
        )
        self._stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self._channel) if self._channel else None

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

    def publish(self, model, version: int, links_from: Sequence[str] = ()) -> PublishResult:
        """Send the parameters as `version`; raise PublishError (version unchanged) on failure.

        `links_from`: traceparents of the train_step spans this version contains (span links)."""
        start = time.perf_counter()
        attrs = {tracing.ATTR_WEIGHT_VERSION: version}
        with tracing.span("publish_version", attrs, links_from=links_from) as span:
            if self._stub is None:
                return PublishResult(version, 0, time.perf_counter() - start, committed=True)
            from parity.checksum import describe
            from parity.transport import TransferGroup

            named = [(name, param.detach().contiguous()) for name, param in model.named_parameters()]
            metas = describe(named)
            request = broadcast_pb2.PublishVersionRequest(
                version=version,
                model=self.model_name,
                tensors=metas,
                checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
                bucket_bytes=self.bucket_bytes,
            )
            try:
                reply = self._stub.PublishVersion(request, timeout=self.rpc_timeout_s, metadata=self.metadata)
            except grpc.RpcError as exc:
                raise PublishError(f"PublishVersion({version}): {exc.code().name}: {exc.details()}") from exc
            plan = reply.plan
            by_name = dict(named)
            try:
                ordered = [by_name[meta.name] for meta in plan.tensors]
            except KeyError as exc:
                raise PublishError(f"plan names tensor {exc} that the trainer does not have") from None
            group = TransferGroup.join(plan.rendezvous)
            try:
                sent = group.send(ordered, int(plan.bucket_bytes) or self.bucket_bytes)
            finally:
                group.close()
            committed = self._wait_committed(version)
            seconds = time.perf_counter() - start
            span.set_attribute(tracing.ATTR_BYTES, sent)
            span.set_attribute("parity.committed", committed)
            log.info("published version %d: %.1f MB in %.2fs", version, sent / 1e6, seconds)
            return PublishResult(version, sent, seconds, committed)

    def _wait_committed(self, version: int) -> bool:
        if self.wait_committed_s <= 0 or self._stub is None:
            return False
        try:
            reply = self._stub.WaitVersion(
                broadcast_pb2.WaitVersionRequest(
                    version=version,
                    state=broadcast_pb2.VERSION_STATE_COMMITTED,
                    timeout_s=self.wait_committed_s,
                ),
                timeout=self.wait_committed_s + 10,
                metadata=self.metadata,
            )
        except grpc.RpcError as exc:
            raise PublishError(f"WaitVersion({version}): {exc.code().name}: {exc.details()}") from exc
        if reply.version.state == broadcast_pb2.VERSION_STATE_FAILED:
            raise PublishError(f"version {version} failed at the broadcast service: {reply.version.error}")
        return bool(reply.reached)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
