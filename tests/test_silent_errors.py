"""Error paths that must not vanish: a store that cannot answer never means "exclude nobody"; a
reward that raises keeps its cause."""

from __future__ import annotations

import asyncio
import socket
import time

from broadcast.coordinator import Coordinator
from broadcast.membership import Membership
from parity.config.broadcast import BroadcastConfig
from parity.v1 import broadcast_pb2 as pb


def test_an_unreadable_store_excludes_the_members_whose_update_failed() -> None:
    membership = Membership(max_workers=4, heartbeat_timeout_s=30.0, exclude_s=60.0)
    for worker_id in ("w1", "w2"):
        membership.register(pb.RegisterWorkerRequest(worker_id=worker_id, address="127.0.0.1:1"))
    # A port that is bound but never listens: the store's connection is refused, with no race.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        config = BroadcastConfig(data_host="127.0.0.1")
        coordinator = Coordinator(config, None, membership, port, lambda: None)  # type: ignore[arg-type]
        asyncio.run(coordinator._exclude_absent("epoch1-test", ("w1", "w2"), 3, ["w1: recv failed", ""]))
    now = time.monotonic()
    assert (
        membership.live["w1"].excluded_until > now and "store unreadable" in membership.live["w1"].last_error
    )
    assert membership.live["w2"].excluded_until <= now  # its update succeeded: not a suspect
    assert [r.worker_id for r in membership.eligible()] == ["w2"]


def test_a_raising_reward_keeps_its_cause() -> None:
    import pytest

    from rollout.rewards.scorer import Component, RewardFailed, Scorer
    from rollout.tasks.base import Prompt

    def broken(prompt: str, completion: str, answer: str, metadata: object) -> float:
        raise KeyError("answer_field")

    scorer = Scorer([Component(1.0, "broken", function=broken)], "t", timeout_s=30.0)
    with pytest.raises(RewardFailed, match="broken: KeyError") as failed:
        asyncio.run(scorer.score(Prompt("p0", "q", "a"), ["x"]))
    assert isinstance(failed.value.__cause__, KeyError)  # the traceback leads to the reward's own line
