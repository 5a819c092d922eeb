"""Watch the broadcast service's version events through Redis pub/sub, gapless through gRPC.

    watch = VersionWatch(broadcast_address, redis_url, stream, kinds=[pb.VERSION_EVENT_KIND_PUBLISHED])
    async for event in watch.events():   # pb.VersionEvent, in the service's order
        ...

Why: `WatchVersions` costs the service one Python-level gRPC stream write per watcher per event
(~0.2 ms each here: ~200 ms of the service's CPU per version at 1,000 watchers). With
`broadcast.notify_redis` on, the service also publishes every event once, serialized once as
protobuf bytes, to the Redis channel of its kind (`channel(stream, kind)`:
`<run.stream>:versions:<kind>`), and Redis fans it out to the subscribers in C.

Semantics, the same as `WatchVersions(after_version, kinds)`:
- **Catch-up.** The watch first SUBSCRIBEs (and waits for Redis to confirm every channel), then
  reads the kept events through gRPC (`WatchVersions(replay_only=True)`: events of versions >
  after_version), so an event emitted between the subscription and the first message is either in
  that replay or on the channel, never in neither.
- **Order and exactly once.** Every event carries `seq` (+1 per event in the service's log, growing
  across service restarts). Events are yielded in increasing seq, each once: anything at or below the
  last yielded seq (a replayed event also on the channel, a batch the service re-published after a
  Redis error) is dropped. One Redis connection delivers its channels' messages in publish order,
  and the service publishes in log order, retrying a failed batch before anything later.
- **No silent loss.** Redis drops pub/sub messages only by dropping the subscriber's connection, so
  after any connection error the watch reconnects (capped exponential backoff), resubscribes and
  catches up through gRPC from its last seq. When nothing arrives for `resync_s`, it also asks gRPC
  for anything after its last seq (a service with notify_redis off, or a publisher still retrying):
  such events come late but in order, and `resynced` counts them. What the service's bounded log
  (10,000 events) no longer holds cannot be replayed, as with WatchVersions.
- **Timeouts.** Every Redis and gRPC wait has one; an outage longer than `outage_timeout_s` raises
  `WatchUnavailable`, which says what was unreachable. A connection that stays quiet is checked by a
  watchdog, not by a deadline on each read: after `resync_s` without a message it sends PING on the
  subscription; the PONG wakes the reader, which then does the quiet resync above. No PONG within
  `timeout_s` (a Redis that froze, a dead link that sent no FIN) closes the connection, and the watch
  reconnects and catches up as after any error.

Cost: the reader blocks on the socket with no timer of its own, and the connection speaks RESP2.
`bench/pubsub_read.py` (500 subscribers in one process, redis-py 8.1 with hiredis, 2 runs on this
2-core box): a per-message read deadline (`get_message(timeout=...)`, RESP3) cost 76-82 us of CPU per
subscriber per message; the blocking RESP2 read costs 0.59-0.63x that (48 us). Every deadline is a
timer in the event loop's heap; with hundreds of watchers in one process (a simulation, a proxy)
they dominated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

import grpc
import redis.asyncio as aioredis
from redis import exceptions as rexc

from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
KIND_NAMES: dict[int, str] = {
    value: name.removeprefix("VERSION_EVENT_KIND_").lower()
    for name, value in pb.VersionEventKind.items()
    if value != pb.VERSION_EVENT_KIND_UNSPECIFIED
}


def channel(stream: str, kind: int) -> str:
    """The Redis pub/sub channel of one event kind, named from the run's stream key."""
    return f"{stream}:versions:{KIND_NAMES[kind]}"


class WatchUnavailable(RuntimeError):
    """Redis or the broadcast service stayed unreachable past the watch's outage limit."""


class VersionWatch:
    """Version events from Redis pub/sub, caught up and checked through the gRPC API (module doc)."""

    def __init__(
        self,
        broadcast_address: str,
        redis_url: str,
        stream: str,
        kinds: Iterable[int] = (),
        after_version: int = 0,
        token: str = "",
        timeout_s: float = 10.0,
        resync_s: float = 10.0,
        outage_timeout_s: float = 600.0,
    ) -> None:
        kinds = tuple(sorted(set(kinds)))
        unknown = [k for k in kinds if k not in KIND_NAMES]
        if unknown:
            raise ValueError(f"kinds: unknown event kind(s) {unknown}; leave empty for all")
        if after_version < 0:
            raise ValueError("after_version: must be >= 0")
        if not (timeout_s > 0 and resync_s > 0 and outage_timeout_s > 0):
            raise ValueError("timeout_s, resync_s, outage_timeout_s: must be > 0")
        self.broadcast_address, self.redis_url, self.token = broadcast_address, redis_url, token
        self.kinds, self.after_version = kinds, after_version
        self.channels = [channel(stream, k) for k in (kinds or tuple(KIND_NAMES))]
        self.timeout_s, self.resync_s, self.outage_timeout_s = timeout_s, resync_s, outage_timeout_s
        self.last_seq = 0  # the seq of the last event yielded
        # what happened, for callers and tests
        self.reconnects = 0
        self.resynced = 0  # events that came through a gRPC catch-up after the first one
        self.duplicates = 0  # messages dropped as already yielded
        # set once the first subscription is confirmed and the first catch-up read is done: every
        # event after that comes through Redis or a later catch-up (counted in `resynced`)
        self.subscribed = asyncio.Event()
        self._heard = 0.0  # loop time of the last message on the subscription (the watchdog's input)

    # -- gRPC: the catch-up read ------------------------------------------------------------------
    async def _replay(self, stub) -> list[pb.VersionEvent]:
        from parity.server import bearer

        request = pb.WatchVersionsRequest(
            after_version=self.after_version, kinds=self.kinds, after_seq=self.last_seq, replay_only=True
        )
        call = stub.WatchVersions(request, metadata=bearer(self.token), timeout=self.timeout_s)
        return [reply.event async for reply in call]

    def _fresh(self, event: pb.VersionEvent) -> bool:
        if event.seq <= self.last_seq:
            self.duplicates += 1
            return False
        self.last_seq = event.seq
        return True

    # -- Redis: the fast path ---------------------------------------------------------------------
    async def _watchdog(self, pubsub) -> None:
        """After resync_s of quiet, PING the subscription (its PONG wakes the reader for a resync);
        without a PONG in timeout_s, close the connection so that the reader fails and reconnects."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, self._heard + self.resync_s - loop.time()))
            if loop.time() - self._heard < self.resync_s:
                continue
            asked = loop.time()
            try:
                await asyncio.wait_for(pubsub.ping(), self.timeout_s)
            except Exception as exc:  # a failed write: the reader's read fails the same way
                log.debug("version watch: ping: %r", exc)
            deadline = asked + self.timeout_s
            while self._heard < asked and loop.time() < deadline:
                await asyncio.sleep(min(0.05, self.timeout_s / 10))
            if self._heard < asked:
                log.warning("version watch: no PONG from redis in %.1fs; reconnecting", self.timeout_s)
                await pubsub.connection.disconnect()
                return

    async def _subscribe(self, pubsub) -> list[pb.VersionEvent]:
        """SUBSCRIBE and wait for every confirmation; messages that came meanwhile are returned."""
        early: list[pb.VersionEvent] = []
        await asyncio.wait_for(pubsub.subscribe(*self.channels), self.timeout_s)
        pending = set(self.channels)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"redis did not confirm SUBSCRIBE {sorted(pending)} in {self.timeout_s}s")
            message = await pubsub.get_message(timeout=remaining)
            if message is None:
                continue
            if message["type"] == "subscribe":
                pending.discard(_text(message["channel"]))
            elif message["type"] == "message":
                early.append(pb.VersionEvent.FromString(message["data"]))
        return early

    async def events(self) -> AsyncIterator[pb.VersionEvent]:
        """Every event of the wanted kinds, in seq order, once; runs until cancelled or an outage
        outlasts outage_timeout_s (WatchUnavailable)."""
        from parity.server import channel as grpc_channel

        delay_s, down_since, first = BACKOFF_START_S, None, True
        async with grpc_channel(self.broadcast_address) as chan:
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            while True:
                client = aioredis.from_url(
                    self.redis_url,
                    socket_connect_timeout=self.timeout_s,
                    socket_timeout=self.timeout_s,  # commands; the subscription's reads block (watchdog)
                    health_check_interval=0,  # the watchdog pings instead
                    protocol=2,  # cheaper per pushed message than RESP3 (module doc)
                )
                pubsub = client.pubsub(ignore_subscribe_messages=False)
                watchdog = None
                try:
                    early = await self._subscribe(pubsub)
                    caught_up = await self._replay(stub)
                    self.subscribed.set()
                    for event in caught_up + sorted(early, key=lambda e: e.seq):
                        if self._fresh(event):
                            if not first:
                                self.resynced += 1
                            yield event
                    if down_since is not None:
                        log.warning("version watch: reconnected after %.1fs", time.monotonic() - down_since)
                    delay_s, down_since, first = BACKOFF_START_S, None, False
                    loop = asyncio.get_running_loop()
                    self._heard = loop.time()
                    watchdog = asyncio.ensure_future(self._watchdog(pubsub))
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                        self._heard = loop.time()
                        if message is None:
                            continue
                        if message["type"] == "pong":  # quiet for resync_s: ask the source of truth
                            for event in await self._replay(stub):
                                if self._fresh(event):
                                    self.resynced += 1
                                    yield event
                            continue
                        if message["type"] != "message":
                            continue
                        event = pb.VersionEvent.FromString(message["data"])
                        if self._fresh(event):
                            yield event
                except rexc.AuthenticationError as exc:
                    raise WatchUnavailable(f"redis refused the password of run.redis_url: {exc}") from exc
                except (
                    rexc.ConnectionError,
                    rexc.TimeoutError,
                    TimeoutError,
                    OSError,
                    grpc.aio.AioRpcError,
                ) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in RETRIED:
                        raise  # a refused request (UNAUTHENTICATED, INVALID_ARGUMENT): not an outage
                    now = time.monotonic()
                    if down_since is None:
                        down_since = now
                        log.warning("version watch: %s; reconnecting with backoff", _describe(exc))
                    if now - down_since > self.outage_timeout_s:
                        raise WatchUnavailable(
                            f"version watch: no connection for {now - down_since:.0f}s "
                            f"(limit {self.outage_timeout_s:.0f}s): {_describe(exc)}"
                        ) from exc
                    self.reconnects += 1
                    await asyncio.sleep(delay_s)
                    delay_s = min(BACKOFF_CAP_S, 2 * delay_s)
                finally:
                    if watchdog is not None:
                        watchdog.cancel()
                        await asyncio.gather(watchdog, return_exceptions=True)
                    await _close(pubsub, client)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"broadcast service: {exc.code().name}: {exc.details()}"
    return f"redis: {type(exc).__name__}: {exc}"


async def _close(pubsub, client) -> None:
    for closing in (pubsub.aclose, client.aclose):
        try:
            await asyncio.wait_for(closing(), 2.0)
        except Exception as exc:  # closing a broken connection: nothing to recover
            log.debug("version watch: close: %s", exc)
