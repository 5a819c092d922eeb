"""Membership with the weight-broadcast service: register, heartbeat, re-register when dropped.

Invariants:
  - Until RegisterWorker succeeds the service is NOT_SERVING; after it, the service serves once its
    weight version is >= the `latest_version` of the registration reply (the broadcast service
    pushes that version to a worker that registers behind).
  - A heartbeat answered FAILED_PRECONDITION/NOT_FOUND (the worker was dropped) triggers a new
    registration; transient errors are retried at the heartbeat interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from parity.server import bearer, channel
from parity.v1 import broadcast_pb2, broadcast_pb2_grpc

log = logging.getLogger("parity.rollout.membership")


class BroadcastLink:
    def __init__(self, config, servicer, address: str) -> None:
        self.config = config
        self.servicer = servicer
        self.address = address
        self.worker_id = config.worker_id or address
        self.interval_s = config.heartbeat_interval_s
        self._channel = channel(config.broadcast_address)
        self._stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self._channel)
        self._metadata = bearer(config.auth_token)

    async def register(self) -> None:
        delay_s = 0.2
        while True:
            try:
                reply = await self._stub.RegisterWorker(
                    broadcast_pb2.RegisterWorkerRequest(
                        worker_id=self.worker_id,
                        address=self.address,
                        weight_version=self.servicer.engine.weight_version,
                    ),
                    timeout=10.0,
                    metadata=self._metadata,
                )
                break
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "RegisterWorker at %s failed (%s); retrying",
                    self.config.broadcast_address,
                    exc.code().name,
                )
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)
        self.servicer.required_version = max(self.servicer.required_version, int(reply.latest_version))
        self.servicer.registered = True
        if reply.heartbeat_interval_s > 0:
            self.interval_s = float(reply.heartbeat_interval_s)
        log.info(
            "registered as %s with %s: latest version %d, serving %d",
            self.worker_id,
            self.config.broadcast_address,
            reply.latest_version,
            self.servicer.engine.weight_version,
        )
        await self.servicer.refresh_serving()

    async def run(self) -> None:
        await self.register()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._stub.Heartbeat(
                    broadcast_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, weight_version=self.servicer.engine.weight_version
                    ),
                    timeout=max(1.0, self.interval_s),
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    log.warning("dropped by the broadcast service (%s); registering again", exc.details())
                    await self.register()
                else:
                    log.warning("heartbeat failed: %s", exc.code().name)

    async def unregister(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await self._stub.UnregisterWorker(
                broadcast_pb2.UnregisterWorkerRequest(worker_id=self.worker_id),
                timeout=2.0,
                metadata=self._metadata,
            )
        await self._channel.close()
