"""Publish the event log to Redis pub/sub (`broadcast.notify_redis`), for parity/weights/version_watch.py.

Invariants:
- Every event of the log is published once per attempt, serialized once (protobuf bytes, no pickle),
  to the channel of its kind (`parity.weights.version_watch.channel`), in log (seq) order: one pipeline per
  batch of new events over one connection, so Redis delivers them in that order.
- The cursor moves only after a batch succeeded; a failed batch (Redis down, a timeout) is
  re-published whole after a capped backoff, so a subscriber may see an event twice (it drops
  seq <= its last) but never a later event before an earlier one. Nothing is buffered beyond the
  bounded event log; events that fall off it during a long outage are skipped with a warning, and
  watchers replay what the log still holds through gRPC.
- Every Redis call has a timeout; the gauge parity_broadcast_notify_redis_connected says whether
  the last one succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis import exceptions as rexc

from broadcast.events import EventLog
from parity.weights.version_watch import BACKOFF_CAP_S, BACKOFF_START_S, channel

log = logging.getLogger(__name__)
MAX_BATCH = 1024

CONNECTED = Gauge(
    "parity_broadcast_notify_redis_connected",
    "1 while the last publish of version events to Redis succeeded, 0 while it fails.",
)
PUBLISHED = Counter(
    "parity_broadcast_notify_redis_events", "Version events published to Redis pub/sub (retries included)."
)


class RedisNotifier:
    """Follows the event log from its first event and PUBLISHes each one to its kind's channel."""

    def __init__(self, events: EventLog, redis_url: str, stream: str, timeout_s: float = 5.0) -> None:
        self.events, self.stream, self.timeout_s = events, stream, timeout_s
        self.client = aioredis.from_url(redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        self.cursor = events.next_seq  # the log is empty when the service starts
        self.published = 0
        CONNECTED.set(float("nan"))  # unknown until the first publish (never a fake 0 or 1)

    async def _publish(self, batch) -> None:
        pipe = self.client.pipeline(transaction=False)
        for event in batch:
            pipe.publish(channel(self.stream, event.kind), event.SerializeToString())
        await asyncio.wait_for(pipe.execute(), self.timeout_s)

    async def run(self) -> None:
        delay_s, down_since = BACKOFF_START_S, None
        try:
            while True:
                waiter = self.events.waiter()
                batch = self.events.since(self.cursor)[:MAX_BATCH]
                if not batch:
                    await waiter.wait()
                    continue
                if batch[0].seq > self.cursor:
                    log.warning(
                        "notify_redis: %d event(s) fell off the event log before reaching Redis",
                        batch[0].seq - self.cursor,
                    )
                try:
                    await self._publish(batch)
                except rexc.AuthenticationError:
                    CONNECTED.set(0)
                    log.error("notify_redis: redis refused the password of run.redis_url; not publishing")
                    raise
                except (rexc.ConnectionError, rexc.TimeoutError, TimeoutError, OSError) as exc:
                    CONNECTED.set(0)
                    if down_since is None:
                        down_since = time.monotonic()
                        log.warning("notify_redis: %s: %s; retrying with backoff", type(exc).__name__, exc)
                    await asyncio.sleep(delay_s)
                    delay_s = min(BACKOFF_CAP_S, 2 * delay_s)
                    continue
                if down_since is not None:
                    log.warning("notify_redis: redis back after %.1fs", time.monotonic() - down_since)
                CONNECTED.set(1)
                delay_s, down_since = BACKOFF_START_S, None
                self.cursor = batch[-1].seq + 1
                self.published += len(batch)
                PUBLISHED.inc(len(batch))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.aclose(), 2.0)
