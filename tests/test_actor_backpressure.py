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


def test_a_sync_loop_restarted_mid_step_finishes_its_share_and_loses_no_prompt() -> None:
    """Sync mode, 4 groups a step: the third publish fails (Redis out past its limit), the loop's
    supervisor starts it again at the same version. It must publish the 2 missing groups, not a
    whole share again (which put half of every later step at lag 1), starting with the draw whose
    publish failed (a draw is never skipped)."""
    import asyncio
    from types import SimpleNamespace

    from parity.config import load
    from parity.v1 import rollouts_pb2
    from rollout.actor import Actor

    cfg = load(
        [
            "--model",
            "tiny",
            "--mode",
            "sync",
            "--groups_per_step",
            "4",
            "--max_groups",
            "6",
            "--concurrency",
            "2",
        ],
        home="rollout",
        environ={},
    ).config
    servicer = SimpleNamespace(engine=SimpleNamespace(weight_version=0), shutting_down=False, caught_up=True)
    actor = Actor(cfg, servicer)
    published: list[tuple[int, int]] = []  # (version, draw)
    fail_at = [3]

    async def one_group(prompt, seed=None, draw=None):
        return rollouts_pb2.RolloutGroup(
            group_id=f"d{draw}", max_weight_version=servicer.engine.weight_version
        )

    async def offer(group) -> bool:
        if len(published) + 1 == fail_at[0]:
            fail_at[0] = 0
            raise ConnectionError("redis is out")
        published.append((servicer.engine.weight_version, int(group.group_id[1:])))
        actor.groups_published += 1
        if len(published) == 4:
            servicer.engine.weight_version = 1  # the trainer stepped and published
        return True

    actor.one_group, actor.offer = one_group, offer

    async def supervised() -> None:
        for _ in range(3):
            try:
                await asyncio.wait_for(actor._sync_loop(), timeout=30)
                return
            except ConnectionError:
                continue

    asyncio.run(supervised())
    # step 1 whole at v0 (its third draw published after the restart), then one whole step at v1
    assert [v for v, _ in published] == [0, 0, 0, 0, 1, 1, 1, 1], published
    assert sorted(d for _, d in published) == list(range(8))  # every draw, none skipped or twice
    assert [d for v, d in published if v == 0] == [0, 1, 2, 3]
