"""Environments for multi-turn episodes (docs/environments.md).

A user writes an `Environment` (synchronous: `reset(record) -> observation`,
`step(action) -> (observation, reward, done)`) in Python, or an `EnvironmentService` in any
language; `--task env:...` picks one (`get_environment`). The episode runner sees only
`EnvironmentSource` and `AsyncEpisodeEnv`: every call has a deadline, every result is validated, and
any failure is one `EnvironmentFailed` with a reason.

  base.py       the protocol, the async episode (deadlines, validation), LocalEnv, the sources
  builtin.py    env:calculator and env:guess_number
  remote.py     env:grpc:HOST:PORT (RemoteEnv, RemoteSource)
  loading.py    get_environment(spec, seed, config)
"""

from __future__ import annotations

from rollout.environments.base import (
    AsyncEpisodeEnv,
    Environment,
    EnvironmentFailed,
    EnvironmentSource,
    FailureReason,
    LocalEnv,
    LocalSource,
    StepResult,
)
from rollout.environments.loading import get_environment, is_environment_spec

__all__ = [
    "AsyncEpisodeEnv",
    "Environment",
    "EnvironmentFailed",
    "EnvironmentSource",
    "FailureReason",
    "LocalEnv",
    "LocalSource",
    "StepResult",
    "get_environment",
    "is_environment_spec",
]
