"""The rollout queue: one Redis stream, one consumer group, at-least-once delivery.

Producers (rollout actors) `publish` one `RolloutGroup` per entry and read `backlog()` for
backpressure. The trainer consumes through the consumer group. Invariants:

- **Ack after use.** An entry stays in the group's pending list (PEL) from `XREADGROUP` until the
  trainer calls `ack` after the optimizer step that used it has been applied. A consumer that dies
  leaves its entries pending; `read` takes them over with `XAUTOCLAIM` once idle `claim_idle_ms`.
- **Trimming never drops an unconsumed entry.** The stream is trimmed (by `publish`, when it is
  longer than `maxlen`) with `XTRIM MINID` to the *safe point*: the smallest of, over every group,
  the oldest pending id, the first undelivered id, and the group's *replay floor*. Entries below it
  have been acknowledged by every group. The stream can exceed `maxlen` only by entries that are
  still unconsumed (the actor's backpressure on `backlog()` bounds those).
- **Replay floor.** The trainer checkpoints every few steps; entries acknowledged after its last
  checkpoint must be consumed again after a crash. `set_replay_floor(id)` (written after each
  durable checkpoint) keeps every entry >= id in the stream, and `rewind(id)` makes the group
  deliver them again on restart, each once: the pending list (all >= id) is released, since `>`
  delivers those entries again. Without a floor nothing acknowledged is trimmed (safe default).
- **Dedupe is the consumer's job** (by rollout id; the trainer persists its set with the checkpoint
  so that it always matches the weights it describes).
- **Redis outages are waited out.** Every command goes through `ReconnectingRedis`: on a lost
  connection (Redis killed, restarting, loading its append-only file) it retries with capped
  exponential backoff (`BACKOFF_START_S` doubling to `BACKOFF_CAP_S`, so it is back within
  `BACKOFF_CAP_S` of Redis answering again) for up to `OUTAGE_TIMEOUT_S`, then raises (a client
  that never reached Redis gives up after `FIRST_CONNECT_TIMEOUT_S`: a wrong URL). While it
  waits, `redis_connected()` is False and each service's `parity_<service>_redis_connected` gauge
  (`connection_gauge`) is 0; services turn NOT_SERVING from it. A retried XADD whose first attempt reached Redis can leave the group twice
  in the stream: the consumer's dedupe by rollout id skips the copy (trained once). A wrong
  password is not an outage: it raises at once.

- **Producer positions.** `publish(..., position=(producer, draw))` records, in the same Lua
  script as the XADD (atomic: both or neither), the highest prompt draw index `producer` has
  published, in the hash `<stream>:producer_position`. A restarted producer continues after it
  (`producer_position`), so no published prompt is drawn twice; prompts in flight at a crash are
  not published and are skipped.

Entry fields: b"group" (RolloutGroup protobuf bytes), b"traceparent", b"group_id", b"min_version",
b"max_version". Nothing is pickled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import redis
from prometheus_client import Gauge
from redis.backoff import NoBackoff
from redis.retry import Retry

from parity.v1 import rollouts_pb2

log = logging.getLogger(__name__)

DEFAULT_STREAM = "parity:rollouts"
MIN_ID = "0-0"

Delivery = Literal["pending", "claimed", "new"]

# KEYS: stream, position hash; ARGV: producer, draw index, then the entry's field/value pairs.
_PUBLISH_AT_POSITION = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
local current = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > current then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return id
"""


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    """'ms-seq' -> (ms, seq), comparable."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(parts: tuple[int, int]) -> str:
    return f"{parts[0]}-{parts[1]}"


def next_id(entry_id: str) -> str:
    """The smallest id strictly greater than `entry_id`."""
    ms, seq = parse_id(entry_id)
    return format_id((ms, seq + 1))


def previous_id(entry_id: str) -> str:
    """The largest id strictly smaller than `entry_id` ("0-0" stays "0-0")."""
    ms, seq = parse_id(entry_id)
    if seq > 0:
        return format_id((ms, seq - 1))
    if ms > 0:
        return format_id((ms - 1, 2**64 - 1))
    return MIN_ID


def min_id(*ids: str) -> str:
    return min(ids, key=parse_id)


@dataclass(frozen=True)
class QueueEntry:
    """One delivered stream entry. `group` is None when the payload could not be parsed."""

    entry_id: str
    group: rollouts_pb2.RolloutGroup | None
    traceparent: str
    delivery: Delivery
    error: str = ""


BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
SOCKET_TIMEOUT_S = (
    30.0  # a command's reply; above the longest XREADGROUP block (trainer.read_block_ms <= 20 s)
)
OUTAGE_TIMEOUT_S = 600.0
FIRST_CONNECT_TIMEOUT_S = 15.0  # a client that never reached Redis: a wrong URL, not an outage

_connected: bool | None = None  # None until the first command; this process's view of Redis
_gauges: list[Gauge] = []


def redis_connected() -> bool | None:
    """Whether this process's last Redis command succeeded (None before the first one)."""
    return _connected


def connection_gauge(name: str) -> Gauge:
    """A gauge `name` (e.g. parity_trainer_redis_connected) that follows `redis_connected()`: 1 while
    the last command succeeded, 0 while Redis is unreachable, NaN before any command."""
    from prometheus_client import REGISTRY

    gauge = REGISTRY._names_to_collectors.get(name) or Gauge(
        name, "1 while the last Redis command succeeded, 0 while Redis is unreachable, NaN before any."
    )
    gauge.set(float("nan") if _connected is None else float(_connected))
    if gauge not in _gauges:
        _gauges.append(gauge)
    return gauge


def _set_connected(connected: bool) -> None:
    global _connected
    if connected != _connected:
        if _connected is not None or not connected:
            log.warning("redis %s", "reconnected" if connected else "unreachable: retrying with backoff")
        _connected = connected
        for gauge in _gauges:
            gauge.set(1.0 if connected else 0.0)


class ReconnectingRedis(redis.Redis):
    """A Redis client whose commands wait out an outage (module docstring, "Redis outages")."""

    outage_timeout_s = OUTAGE_TIMEOUT_S
    _ever_connected = False

    def execute_command(self, *args, **options):
        delay_s = BACKOFF_START_S
        down_since: float | None = None
        while True:
            try:
                result = super().execute_command(*args, **options)
            except redis.AuthenticationError:
                raise
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                _set_connected(False)
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                limit_s = self.outage_timeout_s if self._ever_connected else FIRST_CONNECT_TIMEOUT_S
                if now - down_since > limit_s:
                    raise redis.ConnectionError(
                        f"redis unreachable for {now - down_since:.0f}s (limit {limit_s:.0f}s): {exc}"
                    ) from exc
                time.sleep(delay_s)
                delay_s = min(BACKOFF_CAP_S, 2 * delay_s)
                continue
            _set_connected(True)
            self._ever_connected = True
            return result


def connect(redis_url: str) -> ReconnectingRedis:
    """A client for `redis_url` that reconnects on its own (redis-py's own retries off). Every read
    has a deadline (SOCKET_TIMEOUT_S, above the longest XREADGROUP block): a Redis gone silent (a
    partition, a paused host) is an outage like a refused connection, not a read that never ends
    (redis-py before 8 has no default)."""
    return ReconnectingRedis.from_url(
        redis_url,
        retry=Retry(NoBackoff(), 0),
        socket_connect_timeout=2.0,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=True,
    )


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


class RolloutQueue:
    """Redis-stream rollout queue with a consumer group (see the module docstring)."""

    def __init__(
        self,
        redis_url: str,
        stream: str = DEFAULT_STREAM,
        group: str = "trainer",
        maxlen: int = 10_000,
    ) -> None:
        if maxlen <= 0:
            raise ValueError(f"maxlen: must be > 0 (got {maxlen})")
        self.redis = connect(redis_url)
        self.stream = stream
        self.group = group
        self.maxlen = maxlen
        self._own_pending_cursor: str | None = MIN_ID
        self._claim_cursor = MIN_ID
        self.ensure_group()

    # ---- shared -------------------------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create the consumer group from the stream's start (idempotent), so no entry is missed."""
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def floor_key(self, group: str | None = None) -> str:
        return f"{self.stream}:replay_floor:{group or self.group}"

    def close(self) -> None:
        self.redis.close()

    # ---- producer -----------------------------------------------------------------------------
    def position_key(self) -> str:
        return f"{self.stream}:producer_position"

    def publish(
        self, group: rollouts_pb2.RolloutGroup, traceparent: str = "", position: tuple[str, int] | None = None
    ) -> str:
        """XADD one group; trims acknowledged history beyond `maxlen`. Returns the entry id.

        `position` = (producer, draw index): recorded atomically with the entry (module docstring)."""
        if not group.group_id:
            raise ValueError("group.group_id: must be set (it is the dedupe key)")
        fields = {
            b"group": group.SerializeToString(),
            b"traceparent": traceparent.encode(),
            b"group_id": group.group_id.encode(),
            b"min_version": str(group.min_weight_version).encode(),
            b"max_version": str(group.max_weight_version).encode(),
        }
        if position is None:
            entry_id = self.redis.xadd(self.stream, fields)
        else:
            producer, draw = position
            fields[b"draw"] = f"{producer}:{int(draw)}".encode()  # audits: each draw published once
            pairs = [item for pair in fields.items() for item in pair]
            entry_id = self.redis.eval(
                _PUBLISH_AT_POSITION, 2, self.stream, self.position_key(), producer, int(draw), *pairs
            )
        if self.redis.xlen(self.stream) > self.maxlen:
            self.trim()
        return _text(entry_id)

    def latest_version(self, floor: str) -> int:
        """The highest weight version any entry >= `floor` carries (0 when none)."""
        return max(
            (int(fields.get(b"max_version", 0)) for _, fields in self.redis.xrange(self.stream, min=floor)),
            default=0,
        )

    def redraw_unusable(
        self, floor: str, lost_versions: list[list[int]], stale_below: int, applied_groups: set[str]
    ) -> dict[str, int]:
        """Remove the entries >= `floor` that the trainer could not train (a token of a lost
        version, or an oldest token below `stale_below`) and that it has not trained, and move each
        producer's recorded position back to just before its first such draw, so that an actor
        started afterwards draws those prompts again, with the same seeds, under the restored
        weights. This is a sync-mode resume: the run then trains what an uninterrupted run would
        have. Entries without a recorded draw are left to the consumer, which drops them. Returns
        {producer: the first draw it will draw again}."""
        doomed: list[str] = []
        first: dict[str, int] = {}
        for entry_id, fields in self.redis.xrange(self.stream, min=floor):
            low, high = int(fields.get(b"min_version", -1)), int(fields.get(b"max_version", -1))
            draw = _text(fields.get(b"draw", b""))
            lost = any(a <= high and low <= b for a, b in lost_versions)
            if (
                not draw
                or _text(fields.get(b"group_id", b"")) in applied_groups
                or not (lost or low < stale_below)
            ):
                continue
            producer, _, index = draw.rpartition(":")
            doomed.append(_text(entry_id))
            first[producer] = min(first.get(producer, int(index)), int(index))
        if not doomed:
            return {}
        self.ack(doomed)
        self.redis.xdel(self.stream, *doomed)
        for producer, index in first.items():
            current = self.producer_position(producer)
            if current is None or current >= index:
                if index == 0:
                    self.redis.hdel(self.position_key(), producer)
                else:
                    self.redis.hset(self.position_key(), producer, index - 1)
        return first

    def producer_position(self, producer: str) -> int | None:
        """The highest draw index `producer` has published (None: nothing yet)."""
        value = self.redis.hget(self.position_key(), producer)
        return None if value is None else int(value)

    def backlog(self) -> int:
        """Entries not yet acknowledged by this group: undelivered + pending."""
        info = self._group_info(self.group)
        if info is None:
            return int(self.redis.xlen(self.stream))
        lag = info.get("lag")
        if lag is None:  # Redis cannot tell (after a rewind); count the undelivered ids.
            lag = self._count_after(_text(info["last-delivered-id"]))
        return int(lag) + int(info["pending"])

    # ---- trimming -----------------------------------------------------------------------------
    def safe_trim_id(self) -> str:
        """Every entry with an id below this is acknowledged by every group and below every floor."""
        safe: str | None = None
        for info in self.redis.xinfo_groups(self.stream):
            name = _text(info["name"])
            candidates = [next_id(_text(info["last-delivered-id"]))]
            if int(info["pending"]) > 0:
                summary = self.redis.xpending(self.stream, name)
                candidates.append(_text(summary["min"]))
            floor = self.redis.get(self.floor_key(name))
            candidates.append(_text(floor) if floor else MIN_ID)
            group_safe = min_id(*candidates)
            safe = group_safe if safe is None else min_id(safe, group_safe)
        return safe or MIN_ID  # no group yet: everything is unconsumed

    def trim(self) -> int:
        """Drop acknowledged history below the safe point; returns the number of entries removed."""
        safe = self.safe_trim_id()
        if safe == MIN_ID:
            return 0
        removed = int(self.redis.xtrim(self.stream, minid=safe, approximate=False))
        if removed:
            log.debug("trimmed %d acknowledged entries below %s", removed, safe)
        return removed

    def set_replay_floor(self, entry_id: str) -> None:
        """Keep every entry >= `entry_id` (call after a durable checkpoint covering all below it)."""
        self.redis.set(self.floor_key(), entry_id)

    def replay_floor(self) -> str:
        value = self.redis.get(self.floor_key())
        return _text(value) if value else MIN_ID

    # ---- consumer -----------------------------------------------------------------------------
    def consumed_floor(self) -> str:
        """The smallest id this group has not fully acknowledged (oldest pending or undelivered)."""
        info = self._group_info(self.group)
        if info is None:
            return MIN_ID
        candidates = [next_id(_text(info["last-delivered-id"]))]
        if int(info["pending"]) > 0:
            candidates.append(_text(self.redis.xpending(self.stream, self.group)["min"]))
        return min_id(*candidates)

    def rewind(self, floor: str) -> int:
        """Deliver every entry >= `floor` again (restart after a crash: replay since the checkpoint).

        Pending entries are all >= floor (the floor never passes the oldest pending entry), so
        `XREADGROUP >` delivers them again. They are acknowledged here (after the SETID, so that
        no entry is ever neither pending nor undelivered): left in the pending list, `claim` would
        deliver them a second time, and an entry the trainer skipped and acknowledged after the
        claim would be pending again after the `>` delivery, never read nor acknowledged, in the
        actors' backlog for good. Returns how many pending entries were released this way."""
        # With ENTRIESREAD given, Redis keeps counting the group's lag after the SETID; without it
        # the lag reads "unknown", and every `backlog()` (the actors poll it) scanned the whole
        # undelivered backlog, payloads included. One scan of the ids here instead.
        start = previous_id(floor)
        again = self._count_after(start)
        added = int(self.redis.xinfo_stream(self.stream)["entries-added"])
        self.redis.xgroup_setid(self.stream, self.group, start, entries_read=max(0, added - again))
        released = 0
        while True:
            rows = self.redis.xpending_range(self.stream, self.group, "-", "+", 1000)
            if not rows:
                break
            released += self.ack([_text(row["message_id"]) for row in rows])
        self._own_pending_cursor = None
        self._claim_cursor = MIN_ID
        return released

    def read(
        self, consumer: str, count: int, block_ms: int = 1000, claim_idle_ms: int = 30_000
    ) -> list[QueueEntry]:
        """Up to `count` entries: this consumer's own pending ones first (after a restart), then
        entries of consumers idle for `claim_idle_ms` (XAUTOCLAIM), then new ones (XREADGROUP >)."""
        out: list[QueueEntry] = []
        if self._own_pending_cursor is not None:
            reply = self.redis.xreadgroup(
                self.group, consumer, {self.stream: self._own_pending_cursor}, count=count
            )
            rows = reply[0][1] if reply else []
            if rows:
                self._own_pending_cursor = _text(rows[-1][0])
                out.extend(self._decode(rows, "pending"))
            else:
                self._own_pending_cursor = None
        if len(out) < count and claim_idle_ms >= 0:
            out.extend(self.claim(consumer, count - len(out), claim_idle_ms))
        if len(out) < count:
            reply = self.redis.xreadgroup(
                self.group,
                consumer,
                {self.stream: ">"},
                count=count - len(out),
                block=None if out or block_ms <= 0 else block_ms,
            )
            rows = reply[0][1] if reply else []
            out.extend(self._decode(rows, "new"))
        return out

    def claim(self, consumer: str, count: int, min_idle_ms: int) -> list[QueueEntry]:
        """XAUTOCLAIM up to `count` entries pending on any consumer for >= `min_idle_ms`."""
        reply = self.redis.xautoclaim(
            self.stream,
            self.group,
            consumer,
            min_idle_time=min_idle_ms,
            start_id=self._claim_cursor,
            count=count,
        )
        cursor, rows = _text(reply[0]), reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        self._claim_cursor = cursor if cursor else MIN_ID
        if deleted:  # trimmed while pending: nothing left to train; ack so the PEL does not leak
            log.warning("%d pending entries were deleted from the stream: %s", len(deleted), deleted)
            self.ack([_text(d) for d in deleted])
        return self._decode(rows, "claimed")

    def ack(self, entry_ids: list[str]) -> int:
        """XACK; returns how many were pending."""
        if not entry_ids:
            return 0
        return int(self.redis.xack(self.stream, self.group, *entry_ids))

    def pending(self) -> int:
        info = self._group_info(self.group)
        return 0 if info is None else int(info["pending"])

    # ---- helpers ------------------------------------------------------------------------------
    def _group_info(self, group: str) -> dict | None:
        try:
            groups = self.redis.xinfo_groups(self.stream)
        except redis.ResponseError:
            return None
        for info in groups:
            if _text(info["name"]) == group:
                return info
        return None

    def _count_after(self, last_id: str, batch: int = 1000) -> int:
        total, start = 0, f"({last_id}"
        while True:
            rows = self.redis.xrange(self.stream, min=start, max="+", count=batch)
            total += len(rows)
            if len(rows) < batch:
                return total
            start = f"({_text(rows[-1][0])}"

    def _decode(self, rows: list, delivery: Delivery) -> list[QueueEntry]:
        out = []
        for raw_id, fields in rows:
            entry_id = _text(raw_id)
            if not fields:  # pending but trimmed/deleted
                out.append(QueueEntry(entry_id, None, "", delivery, error="entry deleted from stream"))
                continue
            group = rollouts_pb2.RolloutGroup()
            try:
                group.ParseFromString(fields[b"group"])
            except Exception as exc:  # a malformed payload must not stop the consumer
                out.append(QueueEntry(entry_id, None, "", delivery, error=f"bad payload: {exc}"))
                continue
            out.append(QueueEntry(entry_id, group, _text(fields.get(b"traceparent")), delivery))
        return out
