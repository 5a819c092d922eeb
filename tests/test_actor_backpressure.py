"""The async actors' shared backpressure (rollout.actor.may_start): W workers, each seeing the
shared stream backlog but only its own groups in flight, never fill the stream past limit + W - 1
(one worker: the limit), and while there is room some worker can always start a group."""

from __future__ import annotations

import itertools
import random

import pytest

from rollout.actor import backlog_limit, may_start


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize(("max_lag", "groups_per_step"), [(0, 4), (1, 4), (2, 4), (2, 8), (3, 1)])
def test_workers_together_stay_within_the_bound(workers: int, max_lag: int, groups_per_step: int) -> None:
    limit = backlog_limit(max_lag, groups_per_step)
    rng = random.Random(workers * 100 + limit)
    for _ in range(200):  # random interleavings of starts (each group then sits in flight)
        backlog = rng.randrange(0, limit + 1)  # published, not yet consumed
        in_flight = [0] * workers
        for worker in itertools.chain.from_iterable(
            rng.sample(range(workers), workers) for _ in range(4 * limit)
        ):
            if may_start(in_flight[worker], backlog, limit, workers):
                in_flight[worker] += 1
        total = backlog + sum(in_flight)
        assert total <= max(backlog, limit + workers - 1), (backlog, in_flight, limit)
        if workers == 1:
            assert total == max(backlog, limit)  # one worker fills exactly the room
        if backlog < limit:  # room: the workers used it
            assert sum(in_flight) >= 1


def test_a_worker_alone_may_always_take_the_last_slot() -> None:
    # the trainer waits for the last group of its batch: one slot of room must admit someone
    assert may_start(0, backlog=7, limit=8, workers=4)
    assert not may_start(1, backlog=7, limit=8, workers=4)
    assert not may_start(0, backlog=8, limit=8, workers=4)
    # the old rule (own in flight + backlog < limit) let each of 3 workers hold the whole room
    assert sum(may_start(n, 0, 8, 3) for n in range(8)) == 3


def test_a_failed_worker_cancels_its_siblings_and_its_error_is_raised() -> None:
    """The actor's workers run under all_or_none: one that fails takes the others down with it
    (asyncio.gather left them running beside the loop its supervisor restarted)."""
    import asyncio

    from rollout.actor import all_or_none

    cancelled: list[int] = []

    async def sibling(index: int) -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(index)
            raise
        return index

    async def failing() -> int:
        await asyncio.sleep(0.01)
        raise ConnectionError("redis is out")

    async def scenario() -> str:
        try:
            await asyncio.wait_for(all_or_none([sibling(0), failing(), sibling(2)]), timeout=10)
        except ConnectionError as exc:
            return str(exc)
        return "no error"

    assert asyncio.run(scenario()) == "redis is out"
    assert sorted(cancelled) == [0, 2]

    async def fine() -> list:
        async def value(v: int) -> int:
            await asyncio.sleep(0.01 * (3 - v))
            return v

        return await all_or_none(value(v) for v in range(3))

    assert asyncio.run(fine()) == [0, 1, 2]  # in order, whatever order they finish in
