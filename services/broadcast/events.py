"""The event log behind `WatchVersions` and `WaitVersion`.

Invariants: events are appended only on the service's event loop, in the order the state changes
happened; each gets a sequence number; followers never miss an event (they resume from their cursor)
and the log is bounded (the oldest events fall off, and a follower that far behind resumes at the
oldest kept event).
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
        self._next_seq = 0
        self._changed = asyncio.Event()

    def emit(self, kind: int, version: int, worker_id: str = "", error: str = "") -> pb.VersionEvent:
        event = pb.VersionEvent(
            kind=kind, version=version, worker_id=worker_id, error=error, at_unix=time.time()
        )
        self._events.append((self._next_seq, event))
        self._next_seq += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return event

    async def changed(self, timeout_s: float) -> bool:
        """Wait until the next event (True) or the timeout (False)."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False

    async def follow(self, after_version: int) -> AsyncIterator[pb.VersionEvent]:
        """Replay kept events of versions > after_version, then yield every new event as it happens."""
        cursor = 0
        for seq, event in list(self._events):
            cursor = seq + 1
            if event.version > after_version:
                yield event
        while True:
            waiter = self._changed
            pending = [e for s, e in list(self._events) if s >= cursor]
            if self._events:
                cursor = max(cursor, self._events[-1][0] + 1)
            for event in pending:
                yield event
            if not pending:
                await waiter.wait()
