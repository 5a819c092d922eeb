"""The Redis rollout queue against a real redis-server: delivery, ack, claim, trimming, backlog."""

from __future__ import annotations

import time

import redis

from parity.rollout_queue import RolloutQueue, next_id, parse_id, previous_id
from parity.v1 import rollouts_pb2


def make_group(group_id: str, version: int = 0, n: int = 2) -> rollouts_pb2.RolloutGroup:
    group = rollouts_pb2.RolloutGroup(
        group_id=group_id, min_weight_version=version, max_weight_version=version
    )
    for i in range(n):
        group.samples.add(
            rollout_id=f"{group_id}/{i}", token_ids=[1, 2], logprobs=[-0.5, -0.25], reward=float(i)
        )
    return group


def test_publish_then_consume_round_trips_the_protobuf_and_traceparent(redis_url: str) -> None:
    queue = RolloutQueue(redis_url, stream="s", maxlen=100)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ids = [queue.publish(make_group(f"g{i}", version=i), traceparent=tp) for i in range(3)]
    assert [parse_id(i) for i in ids] == sorted(parse_id(i) for i in ids)
    entries = queue.read("c1", count=10, block_ms=10)
    assert [e.entry_id for e in entries] == ids
    assert [e.group.group_id for e in entries] == ["g0", "g1", "g2"]
    assert entries[2].group.samples[1].rollout_id == "g2/1"
    assert entries[0].traceparent == tp and entries[0].delivery == "new"
    raw = redis.Redis.from_url(redis_url).xrange("s", count=1)[0][1]
    assert raw[b"group_id"] == b"g0" and raw[b"min_version"] == b"0" and raw[b"max_version"] == b"0"


def test_backlog_counts_undelivered_plus_pending_and_drops_only_on_ack(redis_url: str) -> None:
    producer = RolloutQueue(redis_url, stream="s")
    assert producer.backlog() == 0
    for i in range(5):
        producer.publish(make_group(f"g{i}"))
    assert producer.backlog() == 5
    consumer = RolloutQueue(redis_url, stream="s")
    entries = consumer.read("c1", count=3, block_ms=10)
    assert len(entries) == 3
    assert producer.backlog() == 5  # delivered but not acknowledged: still backlog
    assert consumer.ack([e.entry_id for e in entries[:2]]) == 2
    assert producer.backlog() == 3
    assert consumer.pending() == 1


def test_unacked_entries_are_redelivered_to_the_same_consumer_after_restart(redis_url: str) -> None:
    queue = RolloutQueue(redis_url, stream="s")
    for i in range(4):
        queue.publish(make_group(f"g{i}"))
    first = RolloutQueue(redis_url, stream="s").read("trainer-0", count=4, block_ms=10)
    RolloutQueue(redis_url, stream="s").ack([first[0].entry_id])  # only g0 was used
    # The consumer process dies; a new one with the same name gets its pending entries first.
    restarted = RolloutQueue(redis_url, stream="s")
    again = restarted.read("trainer-0", count=10, block_ms=10, claim_idle_ms=-1)
    assert [e.group.group_id for e in again] == ["g1", "g2", "g3"]
    assert {e.delivery for e in again} == {"pending"}


def test_xautoclaim_hands_a_dead_consumers_entries_to_a_live_one(redis_url: str) -> None:
    queue = RolloutQueue(redis_url, stream="s")
    for i in range(3):
        queue.publish(make_group(f"g{i}"))
    dead = RolloutQueue(redis_url, stream="s").read("dead", count=2, block_ms=10)
    assert len(dead) == 2
    live = RolloutQueue(redis_url, stream="s")
    # Not idle long enough yet: only the undelivered entry.
    early = live.read("live", count=5, block_ms=10, claim_idle_ms=60_000)
    assert [e.group.group_id for e in early] == ["g2"]
    time.sleep(0.15)
    claimed = live.read("live", count=5, block_ms=10, claim_idle_ms=100)
    # g2 is pending on "live" itself and idle too, so it may come back; g0/g1 must.
    got = {e.group.group_id: e.delivery for e in claimed}
    assert got["g0"] == "claimed" and got["g1"] == "claimed"
    consumers = {c["name"].decode(): c["pending"] for c in live.redis.xinfo_consumers("s", "trainer")}
    assert consumers["dead"] == 0 and consumers["live"] == 3


def test_trimming_never_drops_unconsumed_entries(redis_url: str) -> None:
    queue = RolloutQueue(redis_url, stream="s", maxlen=4)
    ids = [queue.publish(make_group(f"g{i}")) for i in range(10)]
    assert queue.redis.xlen("s") == 10  # nothing consumed: nothing may go
    entries = queue.read("c", count=7, block_ms=10)
    queue.ack([e.entry_id for e in entries[:5]])  # g0..g4 acknowledged, g5/g6 pending, g7.. undelivered
    queue.publish(make_group("g10"))
    assert queue.redis.xlen("s") == 11  # no replay floor yet: acknowledged history is kept
    queue.set_replay_floor(queue.consumed_floor())
    assert queue.consumed_floor() == ids[5]
    queue.publish(make_group("g11"))
    left = [e[0].decode() for e in queue.redis.xrange("s")]
    assert left[0] == ids[5]  # exactly the acknowledged ones below the floor went
    assert len(left) == 7
    # A second group that has not read anything protects everything.
    RolloutQueue(redis_url, stream="s", group="other", maxlen=4)
    assert queue.safe_trim_id() == "0-0" and queue.trim() == 0


def test_replay_floor_protects_acknowledged_entries_and_rewind_redelivers_them(redis_url: str) -> None:
    queue = RolloutQueue(redis_url, stream="s", maxlen=2)
    ids = [queue.publish(make_group(f"g{i}")) for i in range(6)]
    queue.set_replay_floor(ids[0])  # checkpoint covers nothing yet
    first = queue.read("c", count=6, block_ms=10)
    queue.ack([e.entry_id for e in first])  # trained, but not checkpointed
    queue.publish(make_group("g6"))
    assert queue.redis.xlen("s") == 7  # the floor keeps them for replay
    assert queue.backlog() == 1
    queue.rewind(ids[2])  # the checkpoint covered g0 and g1
    # Redis still counts the group's lag after the rewind: the backlog is read, not scanned
    assert queue._group_info(queue.group)["lag"] == 5 and queue.backlog() == 5
    replay = queue.read("c", count=10, block_ms=10)
    assert [e.group.group_id for e in replay] == ["g2", "g3", "g4", "g5", "g6"]
    assert queue._group_info(queue.group)["lag"] == 0 and queue.backlog() == 5  # all pending now


def test_id_helpers_order_ids() -> None:
    assert next_id("5-1") == "5-2"
    assert previous_id("5-0") == f"4-{2**64 - 1}"
    assert previous_id("0-0") == "0-0"
    assert parse_id(previous_id("7-3")) < parse_id("7-3") < parse_id(next_id("7-3"))
