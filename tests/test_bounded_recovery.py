"""Recovery loops have a budget: the rollout service's actor supervisor gives up after a number of
crashes in a row, and its engine recovery after a number of failures in a row (deaths, failed
restarts), each with one line naming the component and the last cause; NOT_SERVING meanwhile, and
every restart counted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from parity.config import ParityConfig
from parity.errors import RequestError
from rollout.engine import RolloutEngine
from services.rollout.server import supervise_actor
from services.rollout.service import RolloutServicer


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


# -- the engine's recovery budget (services/rollout/service.py `recover_engine`) -------------------


class FakeDyingEngine(RolloutEngine):
    """FAKE engine: only death and restart are real here. Each restart fails while `failing_restarts`
    lasts; with `dies_again` the fresh engine dies at once (a crash loop). Generation is never asked
    for: the servicer's recovery, its health and its budget are what these tests drive."""

    name = "fake"
    top_p_impl = "none"
    max_model_len = 64

    def __init__(self, config, model_dir: Path, failing_restarts: int = 0, dies_again: bool = False) -> None:
        super().__init__(config, model_dir)
        self.is_dead, self.restarts = False, 0
        self.failing_restarts, self.dies_again = failing_restarts, dies_again

    def dead(self) -> bool:
        return self.is_dead

    async def restart(self) -> None:
        self.restarts += 1
        if self.restarts <= self.failing_restarts:
            raise RuntimeError(f"no memory for the engine core (restart {self.restarts})")
        self._reset_after_death()
        self.is_dead = self.dies_again

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def encode(self, text, use_chat_template):
        raise NotImplementedError

    def generate(self, spec, stream=False):
        raise NotImplementedError

    async def _pause(self, mode) -> None:
        raise NotImplementedError

    async def _resume(self) -> None:
        raise NotImplementedError

    async def _stage(self, plan, fault_corrupt_tensor):
        raise NotImplementedError

    async def _swap(self, version):
        raise NotImplementedError

    async def _discard_staged(self) -> None:
        raise NotImplementedError


class FakeHealthServer:
    """Records what the servicer sets its health to (GrpcServer.set_serving's only caller here)."""

    def __init__(self) -> None:
        self.states: list[bool] = []

    async def set_serving(self, serving: bool) -> None:
        self.states.append(serving)


def _engine_restarts() -> float:
    return REGISTRY.get_sample_value("parity_rollout_engine_restarts_total") or 0.0


def _servicer(model_dir: Path, attempts: int, **engine_kwargs) -> tuple[RolloutServicer, FakeDyingEngine]:
    config = ParityConfig(model={"name": "tiny"}, rollout={"engine_restart_attempts": attempts})
    engine = FakeDyingEngine(config.rollout, model_dir, **engine_kwargs)
    servicer = RolloutServicer(config, engine, model_dir)
    servicer.server = FakeHealthServer()
    given_up: list[str] = []
    servicer.on_give_up = given_up.append
    servicer.given_up = given_up  # for the assertions
    return servicer, engine


def test_engine_recovery_gives_up_after_its_budget_naming_the_last_cause(tiny_model: Path) -> None:
    """A death and then failing restarts: 3 failures in a row use up a budget of 3."""

    async def scenario() -> tuple[RolloutServicer, FakeDyingEngine, str]:
        servicer, engine = _servicer(tiny_model, attempts=3, failing_restarts=100)
        await servicer.refresh_serving()
        assert servicer.server.states == [True]
        engine.is_dead = True
        error = await asyncio.wait_for(servicer.recover_engine(start_s=0.01, cap_s=0.02), timeout=30)
        return servicer, engine, error

    before = _engine_restarts()
    servicer, engine, error = asyncio.run(scenario())
    assert engine.restarts == 2  # the death is failure 1, two failed restarts are 2 and 3
    assert _engine_restarts() - before == 1  # one death
    assert error == (
        "rollout engine: gave up after 3 failures in a row (restart budget 3); "
        "last cause: restart failed: RuntimeError: no memory for the engine core (restart 2)"
    )
    assert servicer.given_up == [error] and servicer.engine_gave_up == error
    assert servicer.server.states == [True, False]  # NOT_SERVING from the death on, never again SERVING
    with pytest.raises(RequestError) as refused:
        servicer.check_available()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_engine_crash_loop_is_bounded_and_the_tick_starts_no_more_recoveries(tiny_model: Path) -> None:
    """Restarts that succeed but whose engine dies at once count too (deaths in a row)."""

    async def scenario() -> tuple[RolloutServicer, FakeDyingEngine]:
        servicer, engine = _servicer(tiny_model, attempts=3, dies_again=True)
        engine.is_dead = True
        deadline = time.monotonic() + 30
        while not servicer.engine_gave_up and time.monotonic() < deadline:  # the service's tick
            servicer.watch_engine()
            await asyncio.sleep(0.01)
        await asyncio.wait({servicer._recovery}, timeout=5)
        recovery = servicer._recovery
        for _ in range(5):  # budget used up: the tick leaves the dead engine alone
            servicer.watch_engine()
            await asyncio.sleep(0.01)
        assert servicer._recovery is recovery
        return servicer, engine

    before = _engine_restarts()
    servicer, engine = asyncio.run(scenario())
    assert servicer.engine_gave_up == (
        "rollout engine: gave up after 3 failures in a row (restart budget 3); "
        "last cause: the engine died while serving v0"
    )
    assert servicer.given_up == [servicer.engine_gave_up]
    assert engine.restarts == 2 and _engine_restarts() - before == 3
    assert servicer.engine_down and True not in servicer.server.states


def test_engine_recovery_within_its_budget_serves_again(tiny_model: Path) -> None:
    async def scenario() -> tuple[RolloutServicer, FakeDyingEngine, str]:
        servicer, engine = _servicer(tiny_model, attempts=4, failing_restarts=2)
        engine.weight_version = 3
        engine.is_dead = True
        error = await asyncio.wait_for(servicer.recover_engine(start_s=0.01, cap_s=0.02), timeout=30)
        return servicer, engine, error

    servicer, engine, error = asyncio.run(scenario())
    assert error == "" and not servicer.given_up and engine.restarts == 3
    assert not servicer.engine_down and servicer.required_version == 3
    assert servicer.server.states == []  # never SERVING: it waits for version 3 again (a catch-up)
    engine.weight_version = 3
    asyncio.run(servicer.refresh_serving())
    assert servicer.server.states == [True]


def test_restart_budgets_are_config_fields_with_a_floor_of_one() -> None:
    config = ParityConfig()
    assert config.rollout.engine_restart_attempts == 8 and config.rollout.actor_restart_attempts == 8
    for field in ("engine_restart_attempts", "actor_restart_attempts"):
        with pytest.raises(ValidationError, match=field):
            ParityConfig(rollout={field: 0})


def test_engine_restarts_back_off_doubling_to_the_cap() -> None:
    from services.rollout.service import restart_backoff_s

    assert [restart_backoff_s(retry, 1.0, 30.0) for retry in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_backoff_s(1, 0.25, 30.0) == 0.25
