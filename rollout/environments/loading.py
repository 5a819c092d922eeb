"""`--task env:...`: the environment source that `task.name` names.

    env:NAME                    a built-in environment: calculator | guess_number (builtin.py)
    env:package.module:factory  a Python environment: `factory()` makes one `Environment` per episode
                                (a class is a factory); records come from the factory's
                                `train_records(seed)` / `eval_records(n)` attributes, else from
                                those of the class of the environment it returns
    env:grpc:HOST:PORT          an EnvironmentService (remote.py); records through ListRecords

Invariants: a bad spec raises `TaskError` naming `task.name` at start-up, before any episode; the
environment settings come from the task config (`env_step_timeout_s`, `env_max_observation_chars`,
`env_retries`), with this module's defaults where the config has no such field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout.environments.base import (
    DEFAULT_MAX_OBSERVATION_CHARS,
    DEFAULT_STEP_TIMEOUT_S,
    EnvironmentSource,
    LocalSource,
    is_environment,
)
from rollout.environments.builtin import BUILTIN
from rollout.tasks.base import TaskError
from rollout.tasks.loading import load_object

if TYPE_CHECKING:
    from parity.config.task import TaskConfig

PREFIX = "env:"
DEFAULT_RETRIES = 2
FORMS = "env:NAME (calculator, guess_number), env:package.module:factory or env:grpc:HOST:PORT"


def is_environment_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def get_environment(spec: str, seed: int = 0, config: TaskConfig | Any | None = None) -> EnvironmentSource:
    """The source that `spec` (the value of `task.name`) names; errors name `task.name`."""
    if not is_environment_spec(spec):
        raise TaskError(f"task.name: expected {FORMS}, got {spec!r}")
    body = spec.removeprefix(PREFIX)
    step_timeout_s = float(getattr(config, "env_step_timeout_s", DEFAULT_STEP_TIMEOUT_S))
    max_observation_chars = int(getattr(config, "env_max_observation_chars", DEFAULT_MAX_OBSERVATION_CHARS))
    retries = int(getattr(config, "env_retries", DEFAULT_RETRIES))
    local = {"seed": seed, "step_timeout_s": step_timeout_s, "max_observation_chars": max_observation_chars}
    if body in BUILTIN:
        environment = BUILTIN[body]
        return LocalSource(body, environment, environment.train_records, environment.eval_records, **local)
    if body.startswith("grpc:"):
        from rollout.environments.remote import RemoteSource

        return RemoteSource(_address(spec, body.removeprefix("grpc:")), retries=retries, **local)
    if ":" in body:
        factory = load_object(body, "task.name")
        train_records, eval_records = _records(spec, factory)
        return LocalSource(body, factory, train_records, eval_records, **local)  # type: ignore[arg-type]
    raise TaskError(f"task.name: unknown environment {spec!r}; expected {FORMS}")


def _address(spec: str, address: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TaskError(f"task.name: expected env:grpc:HOST:PORT with a port in 1..65535, got {spec!r}")
    return address


def _records(spec: str, factory: object) -> tuple[Callable, Callable]:
    """(train_records, eval_records) of a Python environment: the factory's, else its class's."""
    if is_environment(factory):
        raise TaskError(
            f"task.name: {spec} names an Environment instance; name a factory (a class, or a function "
            "that returns a fresh environment per episode)"
        )
    if not callable(factory):
        raise TaskError(f"task.name: {spec} is a {type(factory).__name__}, not a factory of environments")
    owner: object = factory
    if not (
        callable(getattr(owner, "train_records", None)) and callable(getattr(owner, "eval_records", None))
    ):
        probe = factory()
        if not is_environment(probe):
            raise TaskError(
                f"task.name: {spec}() returned a {type(probe).__name__}, not an Environment "
                "(it needs reset(record) and step(action))"
            )
        close = getattr(probe, "close", None)
        if callable(close):
            close()
        owner = type(probe)
    train_records, eval_records = getattr(owner, "train_records", None), getattr(owner, "eval_records", None)
    if not (callable(train_records) and callable(eval_records)):
        raise TaskError(
            f"task.name: {spec} gives no records: define train_records(seed) and eval_records(n) on the "
            "factory or on the environment class it returns"
        )
    return train_records, eval_records
