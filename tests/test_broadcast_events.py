"""The broadcast service's event log: followers see every event once, in order, filtered by kind."""

from __future__ import annotations

import asyncio

from broadcast.events import EventLog
from parity.v1 import broadcast_pb2 as pb

PUBLISHED, UPDATED, DISTRIBUTED = (
    pb.VERSION_EVENT_KIND_PUBLISHED,
    pb.VERSION_EVENT_KIND_WORKER_UPDATED,
    pb.VERSION_EVENT_KIND_DISTRIBUTED,
)


async def _collect(log: EventLog, after: int, kinds: frozenset[int], count: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    async for event in log.follow(after, kinds):
        out.append((event.kind, event.version))
        if len(out) == count:
            return out
    return out


def _emit_version(log: EventLog, version: int) -> None:
    log.emit(PUBLISHED, version)
    for worker in ("w0", "w1"):
        log.emit(UPDATED, version, worker)
    log.emit(DISTRIBUTED, version)


def test_followers_replay_then_stream_every_event_once_in_order_and_filter_by_kind() -> None:
    async def scenario() -> tuple[list, list, list]:
        log = EventLog(max_events=1000)
        _emit_version(log, 1)
        _emit_version(log, 2)
        everything = asyncio.create_task(_collect(log, 1, frozenset(), 4 * 3))
        only = asyncio.create_task(_collect(log, 0, frozenset({PUBLISHED, DISTRIBUTED}), 2 * 4))
        # after_version filters the replay only: what happens after the call starts always streams
        late = asyncio.create_task(_collect(log, 3, frozenset({PUBLISHED}), 2))
        await asyncio.sleep(0)
        for version in (3, 4, 5):
            _emit_version(log, version)
            if version == 4:
                await asyncio.sleep(0)  # some events arrive while followers are mid-stream
        return await asyncio.wait_for(asyncio.gather(everything, only, late), timeout=5)

    everything, only, late = asyncio.run(scenario())
    assert everything == [(k, v) for v in (2, 3, 4) for k in (PUBLISHED, UPDATED, UPDATED, DISTRIBUTED)]
    assert only == [(k, v) for v in (1, 2, 3, 4) for k in (PUBLISHED, DISTRIBUTED)]
    assert late == [(PUBLISHED, 3), (PUBLISHED, 4)]


def test_a_follower_behind_the_bounded_log_resumes_at_the_oldest_kept_event() -> None:
    async def scenario() -> list[tuple[int, int]]:
        log = EventLog(max_events=8)
        for version in range(1, 6):  # 20 events, 8 kept: versions 4 and 5
            _emit_version(log, version)
        return await asyncio.wait_for(_collect(log, 0, frozenset({PUBLISHED}), 2), timeout=5)

    assert asyncio.run(scenario()) == [(PUBLISHED, 4), (PUBLISHED, 5)]


def test_a_filtered_watcher_is_woken_only_by_the_kinds_it_asked_for() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        log = EventLog()
        published_only = log.waiter(frozenset({PUBLISHED}))
        everything = log.waiter()
        log.emit(UPDATED, 1, "w0")  # another worker's ack: wakes the unfiltered watchers only
        woken_by_ack = published_only.is_set()
        log.emit(PUBLISHED, 2)
        return woken_by_ack, published_only.is_set(), everything.is_set()

    woken_by_ack, woken_by_publish, unfiltered_woken = asyncio.run(scenario())
    assert not woken_by_ack and woken_by_publish and unfiltered_woken


def test_seq_is_dense_in_order_and_replay_skips_what_a_watcher_has() -> None:
    log = EventLog(max_events=1000)
    for version in (1, 2, 3):
        _emit_version(log, version)
    seqs = [event.seq for event in log.since(0)]
    assert seqs == list(range(seqs[0], seqs[0] + 12)) and seqs[0] > 1_600_000_000 * 10**6
    assert log.next_seq == seqs[-1] + 1
    # the catch-up read of parity/weights/version_watch.py: versions > after_version, seq > after_seq, kinds
    replayed = log.replay(1, frozenset({PUBLISHED, DISTRIBUTED}), after_seq=seqs[4])
    assert [(e.kind, e.version) for e in replayed] == [(DISTRIBUTED, 2), (PUBLISHED, 3), (DISTRIBUTED, 3)]
    assert log.replay(0, frozenset(), after_seq=seqs[-1]) == []
    assert EventLog().next_seq > seqs[-1]  # a restarted service continues above the old seqs
