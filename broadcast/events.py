"""The event log behind `WatchVersions` and `WaitVersion`.

Invariants: events are appended only on the service's event loop, in the order the state changes
happened; each gets a sequence number (`VersionEvent.seq`: +1 per event, starting at the service's
start time in microseconds, so it also grows across restarts); followers never miss an event (they
resume from their cursor) and the log is bounded (the oldest events fall off, and a follower that far
behind resumes at the oldest kept event).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from parity.v1 import broadcast_pb2 as pb

Kind = pb.VersionEventKind


class EventLog:
    """Append-only, bounded, awaitable."""

    def __init__(self, max_events: int = 10_000) -> None:
        self._events: deque[tuple[int, pb.VersionEvent]] = deque(maxlen=max_events)
        self._first_seq = time.time_ns() // 1000  # > every seq of an earlier run of the service
        self._next_seq = self._first_seq
        # One wake-up per filter in use (empty key: every kind), so a watcher that asked for two
        # kinds is not woken for every other worker's events. Few distinct filters exist at once.
        self._changed: dict[frozenset[int], asyncio.Event] = {}

    def emit(self, kind: int, version: int, worker_id: str = "", error: str = "") -> pb.VersionEvent:
        event = pb.VersionEvent(
            kind=kind,
            version=version,
            worker_id=worker_id,
            error=error,
            at_unix=time.time(),
            seq=self._next_seq,
        )
        self._events.append((self._next_seq, event))
        self._next_seq += 1
        for key in [key for key in self._changed if not key or kind in key]:
            self._changed.pop(key).set()  # the next waiter of that filter gets a fresh event
        return event

    def waiter(self, kinds: frozenset[int] = frozenset()) -> asyncio.Event:
        """Set at the next event of `kinds` (empty: any kind). Take it before reading `since`."""
        event = self._changed.get(kinds)
        if event is None:
            event = self._changed[kinds] = asyncio.Event()
        return event

    async def changed(self, timeout_s: float) -> bool:
        """Wait until the next event (True) or the timeout (False)."""
        try:
            await asyncio.wait_for(self.waiter().wait(), timeout=max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False

    @property
    def next_seq(self) -> int:
        """The seq the next event will get."""
        return self._next_seq

    def since(self, cursor: int) -> list[pb.VersionEvent]:
        """Kept events with seq >= cursor, read from the right end: O(new events), not O(log)."""
        if not self._events:
            return []
        count = min(self._next_seq - max(cursor, self._first_seq), len(self._events))
        return [self._events[-i][1] for i in range(count, 0, -1)]

    def replay(
        self, after_version: int, kinds: frozenset[int] = frozenset(), after_seq: int = 0
    ) -> list[pb.VersionEvent]:
        """Kept events of versions > after_version and seq > after_seq, of `kinds` (empty: all)."""
        return [
            event
            for event in self.since(after_seq + 1)
            if event.version > after_version and (not kinds or event.kind in kinds)
        ]

    async def follow(
        self, after_version: int, kinds: frozenset[int] = frozenset(), after_seq: int = 0
    ) -> AsyncIterator[pb.VersionEvent]:
        """Replay kept events of versions > after_version, then yield every new event as it happens.

        `kinds` keeps only those event kinds (empty: every kind). A watcher that needs only
        PUBLISHED/COMMITTED then costs the service nothing for every other worker's acks.
        `after_seq` skips the events a watcher already has (seq <= after_seq).
        """
        wanted = (lambda event: event.kind in kinds) if kinds else (lambda event: True)
        cursor = max(self._next_seq, after_seq + 1)
        for event in self.replay(after_version, kinds, after_seq):
            yield event
        while True:
            waiter = self.waiter(kinds)
            pending = self.since(cursor)
            cursor = self._next_seq
            for event in pending:
                if wanted(event):
                    yield event
            if not pending:
                await waiter.wait()
