"""The reference engine pauses with more requests in flight than any thread pool has threads.

A request waiting out a pause holds a thread. When generation and the pause's wait for the model
lock shared asyncio's default executor (at most 32 threads, fewer on small boxes), the pause queued
behind the requests it had just stopped and never ran: a `parity run` with an eval and the actor in
flight hung in UpdateWeights until its deadline. And a pause cancelled while it waits for the
running step must not keep the model lock it takes afterwards. Real engine, tiny model, in-process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

REQUESTS = 40  # more than the default executor's largest size (32)


def test_a_pause_with_more_requests_than_threads_returns_and_every_request_finishes(tiny_model: Path) -> None:
    from parity.config.rollout import RolloutConfig
    from rollout.engine import GenerationSpec
    from rollout.reference_engine import ReferenceEngine

    engine = ReferenceEngine(RolloutConfig(engine="reference", max_model_len=512), tiny_model)

    async def one(i: int) -> list:
        spec = GenerationSpec(f"r{i}", list(range(10, 20)), n=1, max_tokens=100, temperature=1.0, seed=i,
                              ignore_eos=True)  # fmt: skip
        return [r async for r in engine.generate(spec, stream=True)]

    async def scenario() -> tuple[list, int]:
        await engine.start()
        try:
            tasks = [asyncio.create_task(one(i)) for i in range(REQUESTS)]
            while engine._running < REQUESTS:  # every request admitted; most wait for a thread
                await asyncio.sleep(0.01)
            await asyncio.wait_for(engine.pause("keep"), timeout=60)
            paused_at = engine.weight_version
            await engine.resume()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
            return results, paused_at
        finally:
            await engine.shutdown()

    results, paused_at = asyncio.run(scenario())
    assert paused_at == 0
    assert len(results) == REQUESTS
    assert all(len(r) == 1 and len(r[0].token_ids) == 100 for r in results)


def test_a_pause_cancelled_while_it_waits_for_the_running_step_leaves_the_model_lock_free(
    tiny_model: Path,
) -> None:
    from parity.config.rollout import RolloutConfig
    from rollout.reference_engine import ReferenceEngine

    engine = ReferenceEngine(RolloutConfig(engine="reference", max_model_len=512), tiny_model)

    async def scenario() -> bool:
        engine._model_lock.acquire()  # a generation step is running
        pause = asyncio.create_task(engine._pause("keep"))
        await asyncio.sleep(0.2)  # the pause's thread now waits for the lock
        pause.cancel()  # as when a PauseGeneration call's deadline passes
        await asyncio.gather(pause, return_exceptions=True)
        engine._model_lock.release()  # the step ends: the pause's thread takes the lock
        # A later step (or swap) must get it within a moment.
        free = await asyncio.to_thread(engine._model_lock.acquire, True, 5.0)
        if free:
            engine._model_lock.release()
        await engine.shutdown()
        return free

    assert asyncio.run(scenario())


def test_an_update_cancelled_while_it_pauses_leaves_generation_running() -> None:
    """UpdateWeights' deadline can pass while the engine pauses for the swap: the cancelled update
    must still resume, or every later request would wait for admission forever."""
    from rollout.engine import RolloutEngine
    from tests.conftest import config_for

    class PauseHangs(RolloutEngine):  # a FAKE engine: only the update protocol of the base class
        name = "fake"

        async def start(self): ...
        def encode(self, text, use_chat_template): ...
        def generate(self, spec, stream=False): ...
        async def shutdown(self): ...
        async def _discard_staged(self): ...

        async def _stage(self, plan, fault_corrupt_tensor):
            return {"error": "", "checksums": [], "transfer_s": 0.0, "verify_s": 0.0}

        async def _pause(self, mode):
            await asyncio.sleep(3600)  # the engine's pause, slow

        async def _resume(self):
            self.resumed += 1

        async def _swap(self, version):
            return "", 0.0

    async def scenario() -> PauseHangs:
        from parity.v1 import common_pb2

        engine = PauseHangs(config_for("rollout"), Path("unused"))
        engine.resumed = 0
        update = asyncio.create_task(engine.update_weights(common_pb2.TransferPlan(version=1), "keep"))
        await asyncio.sleep(0.2)
        assert not engine._admission_open.is_set()  # paused, mid-pause
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        await asyncio.wait_for(engine.admitted(), 5)  # a new request is admitted
        return engine

    engine = asyncio.run(scenario())
    assert engine.resumed == 1 and engine.weight_version == 0
