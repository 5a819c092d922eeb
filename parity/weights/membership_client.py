"""A rollout worker's membership with the weight-broadcast service: register, heartbeat, re-register
when dropped, unregister. The rollout service and the tests' stand-in receiver both use it.

    client = MembershipClient(broadcast_address, worker_id, address, auth_token, heartbeat_interval_s,
                              weight_version=lambda: engine.weight_version, on_registered=caught_up_to)
    task = asyncio.create_task(client.run())   # register (retrying), then heartbeat forever
    ...
    task.cancel(); await client.unregister()   # best effort; closes the channel

Invariants:
  - `run` registers before its first heartbeat, retrying with backoff (0.2 s doubling to 5 s) until
    the broadcast service answers. A refusal no retry can change (UNAUTHENTICATED or
    PERMISSION_DENIED: the token; INVALID_ARGUMENT: the worker's id or address) raises
    `MembershipRefused`, naming the setting, instead of retrying forever. Every successful
    registration calls `on_registered` with the reply's `latest_version`: a worker must not serve
    before its weight version reaches it (the broadcast service pushes that version to a worker that
    registers behind).
  - Heartbeats go every `heartbeat_interval_s`, or the interval the registration reply names.
    One answered NOT_FOUND (the worker was dropped, or the service restarted and never knew it)
    triggers a new registration, and so does FAILED_PRECONDITION, the code a broadcast service of
    an older release answers with, so that a mixed-release deployment keeps re-registering; other
    errors are logged and retried at the next beat.
  - Registration and heartbeats report `weight_version()` at the moment of the call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

import grpc

from parity.server import bearer, channel
from parity.v1 import broadcast_pb2, broadcast_pb2_grpc

log = logging.getLogger("parity.membership")

_DROPPED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)  # see the docstring
# refusals that name a setting of this worker (module docstring): no retry can change them
_REFUSED = {
    grpc.StatusCode.UNAUTHENTICATED: "rollout.auth_token",
    grpc.StatusCode.PERMISSION_DENIED: "rollout.auth_token",
    grpc.StatusCode.INVALID_ARGUMENT: "rollout.worker_id or the service's address",
}


class MembershipRefused(RuntimeError):
    """The broadcast service refused this worker's registration for a reason retrying cannot fix."""


class MembershipClient:
    """One worker's membership; see the module docstring for the protocol."""

    def __init__(
        self,
        broadcast_address: str,
        worker_id: str,
        address: str,
        auth_token: str,
        heartbeat_interval_s: float,
        weight_version: Callable[[], int],
        on_registered: Callable[[int], Awaitable[None] | None],
        device_uuid: str = "",
    ) -> None:
        self.broadcast_address = broadcast_address
        self.worker_id = worker_id
        self.address = address
        self.interval_s = heartbeat_interval_s
        self.weight_version = weight_version
        self.on_registered = on_registered
        self.device_uuid = device_uuid  # the engine's GPU ("" on CPU): same GPU as the trainer -> CUDA IPC
        self._channel = channel(broadcast_address)
        self._stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self._channel)
        self._metadata = bearer(auth_token)

    async def register(self) -> int:
        """RegisterWorker until it succeeds; returns the broadcast service's latest version."""
        delay_s = 0.2
        while True:
            try:
                reply = await self._stub.RegisterWorker(
                    broadcast_pb2.RegisterWorkerRequest(
                        worker_id=self.worker_id,
                        address=self.address,
                        weight_version=self.weight_version(),
                        device_uuid=self.device_uuid,
                    ),
                    timeout=10.0,
                    metadata=self._metadata,
                )
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _REFUSED:
                    raise MembershipRefused(
                        f"{_REFUSED[exc.code()]}: the broadcast service at {self.broadcast_address} "
                        f"refused to register worker {self.worker_id!r} ({exc.code().name}: "
                        f"{(exc.details() or '')[:300]})"
                    ) from None
                log.warning(
                    "RegisterWorker at %s failed (%s); retrying", self.broadcast_address, exc.code().name
                )
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)
        if reply.heartbeat_interval_s > 0:
            self.interval_s = float(reply.heartbeat_interval_s)
        latest = int(reply.latest_version)
        log.info(
            "registered as %s with %s: latest version %d, serving %d",
            self.worker_id,
            self.broadcast_address,
            latest,
            self.weight_version(),
        )
        done = self.on_registered(latest)
        if inspect.isawaitable(done):
            await done
        return latest

    async def run(self) -> None:
        """Register, then heartbeat until cancelled (re-registering whenever dropped)."""
        await self.register()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._stub.Heartbeat(
                    broadcast_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, weight_version=self.weight_version()
                    ),
                    timeout=max(1.0, self.interval_s),
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _DROPPED:
                    log.warning("dropped by the broadcast service (%s); registering again", exc.details())
                    await self.register()
                else:
                    log.warning("heartbeat failed: %s", exc.code().name)

    async def unregister(self) -> None:
        """Best effort UnregisterWorker (2 s), then close the channel. A failed call is logged (the
        service drops a silent worker after its heartbeat timeout anyway); a cancellation of the
        caller propagates, after the channel is closed."""
        try:
            await self._stub.UnregisterWorker(
                broadcast_pb2.UnregisterWorkerRequest(worker_id=self.worker_id),
                timeout=2.0,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "UnregisterWorker at %s failed (%s: %s); the service drops %s at its heartbeat timeout",
                self.broadcast_address,
                exc.code().name,
                exc.details(),
                self.worker_id,
            )
        finally:
            await self._channel.close()
