"""Recovery loops have a budget: the rollout service's actor supervisor gives up after a number of
crashes in a row with one line naming the component and the last cause."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from services.rollout.server import supervise_actor


class FakeServicer:
    """The two things the supervisor touches: the actor-failed flag and the health refresh."""

    def __init__(self) -> None:
        self.shutting_down = False
        self.actor_failed = False
        self.not_serving_seen = 0

    async def refresh_serving(self) -> None:
        self.not_serving_seen += int(self.actor_failed)


class FakeCrashingActor:
    """An actor loop that crashes `crashes` times, then finishes."""

    def __init__(self, crashes: int) -> None:
        self.crashes, self.runs = crashes, 0

    async def run(self) -> None:
        self.runs += 1
        if self.runs <= self.crashes:
            raise ConnectionError(f"redis gone (run {self.runs})")


def _restarts() -> float:
    return REGISTRY.get_sample_value("parity_rollout_actor_restarts_total") or 0.0


def test_actor_supervisor_gives_up_after_its_budget_naming_the_last_cause() -> None:
    servicer, actor, before = FakeServicer(), FakeCrashingActor(crashes=100), _restarts()
    error = asyncio.run(supervise_actor(actor, servicer, attempts=3, start_s=0.01, cap_s=0.02))
    assert actor.runs == 3 and _restarts() - before == 3
    assert error.startswith("rollout actor: gave up after 3 crashes in a row (restart budget 3)")
    assert error.endswith("last cause: ConnectionError: redis gone (run 3)") and "\n" not in error
    assert servicer.not_serving_seen == 3  # NOT_SERVING while recovering


def test_actor_supervisor_restarts_within_its_budget() -> None:
    servicer, actor = FakeServicer(), FakeCrashingActor(crashes=2)
    assert asyncio.run(supervise_actor(actor, servicer, attempts=3, start_s=0.01, cap_s=0.02)) == ""
    assert actor.runs == 3 and not servicer.actor_failed
