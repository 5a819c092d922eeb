"""Every call the rollout service makes into vLLM's engine-core process ends when the engine dies.

vLLM never answers a utility call (pause, resume, prefix-cache reset, version label, abort, a
worker RPC) that was sent to an engine core which then died. An UpdateWeights that met the death
inside one of them used to hold its RPC until the broadcast coordinator's deadline (150 s), with the
restarted engine's catch-up queued behind it (seen in `bench/chaos.py --engine vllm`). Here the
engine core is a fake (`_DyingEngineCore`, below): it takes each call and never answers, and its
`errored` flag (what `AsyncLLM.errored` reports once vLLM's monitor saw the process die) is set
while the call waits. Each call must raise EngineDeadError within a few polls of 0.1 s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from parity.config.rollout import RolloutConfig
from rollout.engine import EngineDeadError
from rollout.vllm_engine import VllmEngine


class _DyingEngineCore:
    """Fake AsyncLLM: every call is taken and never answered; `errored` turns True meanwhile."""

    def __init__(self) -> None:
        self.errored = False
        self.calls: list[str] = []

    async def _never(self, name: str) -> None:
        self.calls.append(name)
        await asyncio.Event().wait()

    async def pause_generation(self, **_: object) -> None:
        await self._never("pause_generation")

    async def resume_generation(self) -> None:
        await self._never("resume_generation")

    async def reset_prefix_cache(self) -> bool:
        await self._never("reset_prefix_cache")
        return True

    async def update_weight_version(self, _: str) -> None:
        await self._never("update_weight_version")

    async def collective_rpc(self, method: str, kwargs: dict | None = None) -> list:
        await self._never(method)
        return []


CALLS = {
    "pause": lambda engine: engine.pause("keep"),
    "resume": lambda engine: engine._resume(),
    "swap": lambda engine: engine._swap(3),  # a worker RPC first
    "reset_prefix_cache": lambda engine: engine._reset_prefix_cache(),
    "worker_rpc": lambda engine: engine._rpc_one("parity_stage_result"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_into_an_engine_that_dies_meanwhile_raises_engine_dead(name: str) -> None:
    engine = VllmEngine(RolloutConfig(), Path("unused"))
    core = engine.llm = _DyingEngineCore()

    async def scenario() -> float:
        call = asyncio.ensure_future(CALLS[name](engine))
        await asyncio.sleep(0.3)
        assert not call.done() and core.calls, "the call should be waiting on the engine core"
        died = time.monotonic()
        core.errored = True
        with pytest.raises(EngineDeadError, match="the engine died"):
            await asyncio.wait_for(call, timeout=5.0)
        return time.monotonic() - died

    assert asyncio.run(scenario()) < 2.0
