"""Environments for multi-turn episodes: the user's protocol, the runner's async view, and failure.

    source = get_environment("env:calculator", seed, config.task)   # rollout/environments/loading.py
    env = source.new_episode(episode_id)                              # an AsyncEpisodeEnv
    try:
        observation = await env.reset(record)                         # the first user message
        while not done:
            result = await env.step(action)                           # StepResult, validated
    finally:
        await env.close()                                             # never raises

Invariants:
  - Every reset, step and close has a deadline (`step_timeout_s`); nothing awaits an environment
    longer. A Python environment runs in a daemon thread, never on the event loop; one that hangs
    past the deadline is abandoned (a thread cannot be killed) and its episode fails with reason
    "timeout". Daemon threads never hold the process open at exit, unlike `asyncio.to_thread`'s pool
    (which `asyncio.run` joins) and never starve it. While `MAX_STUCK_CALLS` abandoned calls are still
    running, every Python environment call fails at once with "timeout" rather than pile up threads.
  - An environment that raises, returns a non-string observation, a non-finite or non-numeric reward,
    a non-bool `done`, a step result that is not (observation, reward, done), or an observation
    longer than `max_observation_chars` raises `EnvironmentFailed` (reason error | timeout |
    malformed | oversized) naming the environment, the episode and the call. The runner ends the
    episode with end reason "environment_error" and drops its group: it is never scored 0.
  - An episode is used in order: reset once, step until done, close. A call out of that order is a
    bug in the caller (RuntimeError), not an environment failure. After a failure the episode is
    over; only close may follow.
  - The record handed to `reset` is a deep copy: episodes of one group share a record and an
    environment that mutates its copy cannot affect its siblings.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import numbers
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

log = logging.getLogger(__name__)

FailureReason = Literal["error", "timeout", "malformed", "oversized"]

DEFAULT_STEP_TIMEOUT_S = 30.0
DEFAULT_MAX_OBSERVATION_CHARS = 8192
MAX_STUCK_CALLS = 32


@dataclass(frozen=True)
class StepResult:
    """One step's outcome. `observation` is what the model sees next (ignored once `done`)."""

    observation: str
    reward: float
    done: bool


@runtime_checkable
class Environment(Protocol):
    """A Python environment, written by a user: synchronous, one instance per episode.

    `reset(record)` returns the first observation (the episode's first user message); `step(action)`
    takes the model's turn as text and returns (observation, reward, done). The episode's reward is
    the sum of its steps' rewards. An optional `close()` is called once at the end of the episode.
    """

    def reset(self, record: Mapping[str, Any]) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


class EnvironmentFailed(RuntimeError):
    """An environment call failed; the episode ends with reason environment_error (group dropped).

    `reason`: error (it raised, or the service answered an error status), timeout (no answer within
    the deadline), malformed (a wrong type or shape, a non-finite reward), oversized (an observation
    longer than the limit).
    """

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: FailureReason = reason
        self.message = message


_State = Literal["new", "running", "done", "failed", "closed"]


class AsyncEpisodeEnv(ABC):
    """One episode of an environment, as the episode runner drives it (module docstring).

    Subclasses implement `_reset`, `_step` and `_close` (raw results); this class applies the
    deadline, validates every result and keeps the call order.
    """

    def __init__(
        self,
        name: str,
        episode_id: str,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
    ) -> None:
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be > 0, got {step_timeout_s}")
        if max_observation_chars < 1:
            raise ValueError(f"max_observation_chars: must be >= 1, got {max_observation_chars}")
        self.name, self.episode_id = name, episode_id
        self.step_timeout_s, self.max_observation_chars = step_timeout_s, max_observation_chars
        self.steps_taken = 0
        # The failure that ended the episode, if one did.
        self.failure: EnvironmentFailed | None = None
        self._state: _State = "new"

    @abstractmethod
    async def _reset(self, record: Mapping[str, Any]) -> Any:
        """The raw first observation."""

    @abstractmethod
    async def _step(self, action: str, step_index: int) -> Any:
        """The raw step result: a StepResult or an (observation, reward, done) sequence."""

    @abstractmethod
    async def _close(self) -> None:
        """Free the episode's resources."""

    def _failure(self, reason: FailureReason, call: str, detail: str) -> EnvironmentFailed:
        return EnvironmentFailed(
            reason, f"environment {self.name}, episode {self.episode_id}: {call}: {detail}"
        )

    @property
    def call_deadline_s(self) -> float:
        """The longest any one call may take (a remote environment adds its retries)."""
        return self.step_timeout_s

    async def _call(self, call: str, make: Callable[[], Any]) -> Any:
        try:
            return await asyncio.wait_for(make(), self.call_deadline_s)
        except EnvironmentFailed:
            raise
        except TimeoutError as exc:  # the deadline (no message), or too many stuck calls
            detail = str(exc) or f"no answer within {self.call_deadline_s:g}s"
            raise self._failure("timeout", call, detail) from None
        except Exception as exc:
            raise self._failure("error", call, f"{type(exc).__name__}: {exc}") from None

    def _expect(self, *states: _State, call: str) -> None:
        if self._state not in states:
            raise RuntimeError(
                f"environment {self.name}, episode {self.episode_id}: {call} called while the episode "
                f"is {self._state} (order: reset, step until done, close)"
            )

    async def reset(self, record: Mapping[str, Any]) -> str:
        """The first observation of the episode on `record`, or EnvironmentFailed."""
        self._expect("new", call="reset")
        self._state = "failed"  # until the reset succeeds
        record_copy = copy.deepcopy(dict(record))
        try:
            observation = self._observation(
                await self._call("reset", lambda: self._reset(record_copy)), "reset"
            )
        except EnvironmentFailed as exc:
            self.failure = exc
            raise
        self._state = "running"
        return observation

    async def step(self, action: str) -> StepResult:
        """One model turn applied, or EnvironmentFailed; `done` ends the episode."""
        self._expect("running", call="step")
        if not isinstance(action, str):
            raise TypeError(f"action: expected str, got {type(action).__name__}")
        index = self.steps_taken
        call = f"step {index}"
        self._state = "failed"  # until the step succeeds
        try:
            result = self._step_result(await self._call(call, lambda: self._step(action, index)), call)
        except EnvironmentFailed as exc:
            self.failure = exc
            raise
        self.steps_taken += 1
        self._state = "done" if result.done else "running"
        return result

    async def close(self) -> None:
        """Ends the episode. Never raises: the episode's data is complete; a failure is logged."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closed"
        try:
            await self._call("close", self._close)
        except EnvironmentFailed as exc:
            log.warning("%s", exc)

    def _observation(self, value: Any, call: str) -> str:
        if not isinstance(value, str):
            raise self._failure("malformed", call, f"observation is {type(value).__name__}, not str")
        if len(value) > self.max_observation_chars:
            raise self._failure(
                "oversized",
                call,
                f"observation has {len(value)} characters, over the limit of {self.max_observation_chars}",
            )
        return value

    def _step_result(self, value: Any, call: str) -> StepResult:
        if isinstance(value, StepResult):
            observation, reward, done = value.observation, value.reward, value.done
        elif isinstance(value, (tuple, list)) and len(value) == 3:
            observation, reward, done = value
        else:
            shape = f"a {type(value).__name__}" + (
                f" of {len(value)}" if isinstance(value, (tuple, list)) else ""
            )
            raise self._failure("malformed", call, f"expected (observation, reward, done), got {shape}")
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise self._failure("malformed", call, f"reward is {type(reward).__name__}, not a number")
        if not math.isfinite(float(reward)):
            raise self._failure("malformed", call, f"reward is {float(reward)!r}, not finite")
        if type(done).__name__ not in ("bool", "bool_"):  # bool, or numpy's bool_
            raise self._failure("malformed", call, f"done is {type(done).__name__}, not bool")
        observation = self._observation(observation, call)
        return StepResult(observation=observation, reward=float(reward), done=bool(done))


# --- Python environments -------------------------------------------------------------------------

_abandoned = 0  # calls whose caller gave up (deadline) and whose thread has not returned yet
_abandoned_lock = threading.Lock()


async def run_in_daemon_thread(fn: Callable[[], Any], name: str) -> Any:
    """`fn()` in a fresh daemon thread: its result, or what it raised.

    Cancelling the await (the caller's deadline) abandons the thread, which counts until `fn`
    returns; while `MAX_STUCK_CALLS` abandoned calls are still running, TimeoutError at once.
    """
    global _abandoned
    if _abandoned >= MAX_STUCK_CALLS:
        raise TimeoutError(f"{_abandoned} earlier environment calls are still running past their deadline")
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    call = {"finished": False, "abandoned": False}

    def deliver(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        global _abandoned
        try:
            result, ok = fn(), True
        except BaseException as exc:  # handed to the awaiting coroutine, which reports it
            result, ok = exc, False
        with _abandoned_lock:
            call["finished"] = True
            if call["abandoned"]:
                _abandoned -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed while this call ran past its deadline
            loop.call_soon_threadsafe(deliver, ok, result)

    threading.Thread(target=target, name=f"env:{name}", daemon=True).start()
    try:
        return await future
    except asyncio.CancelledError:
        with _abandoned_lock:
            if not call["finished"]:
                call["abandoned"] = True
                _abandoned += 1
        raise


def is_environment(value: object) -> bool:
    """An Environment instance (not a class, not a factory)."""
    return (
        not isinstance(value, type)
        and callable(getattr(value, "reset", None))
        and callable(getattr(value, "step", None))
    )


class LocalEnv(AsyncEpisodeEnv):
    """An episode of a Python `Environment`, called in daemon threads under the deadline.

    `environment` is an instance, or a zero-argument factory (a class, a function) that makes one;
    a factory is called in the thread of `reset`, under its deadline, so user code never runs on
    the event loop.
    """

    def __init__(
        self,
        environment: Environment | Callable[[], Environment],
        *,
        name: str,
        episode_id: str,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
    ) -> None:
        super().__init__(name, episode_id, step_timeout_s, max_observation_chars)
        if is_environment(environment):
            self._environment: Environment | None = environment  # type: ignore[assignment]
            self._make: Callable[[], Environment] | None = None
        elif callable(environment):
            self._environment, self._make = None, environment
        else:
            raise TypeError(
                f"environment: expected an Environment or a factory, got {type(environment).__name__}"
            )

    def _thread(self, fn: Callable[[], Any], call: str) -> Any:
        return run_in_daemon_thread(fn, f"{self.name}:{self.episode_id}:{call}")

    def _made(self) -> Environment:
        if self._environment is None:
            assert self._make is not None
            made = self._make()
            if not is_environment(made):
                raise EnvironmentFailed(
                    "malformed",
                    f"environment {self.name}, episode {self.episode_id}: reset: the factory returned "
                    f"{type(made).__name__}, which has no reset/step methods",
                )
            self._environment = made
        return self._environment

    async def _reset(self, record: Mapping[str, Any]) -> Any:
        return await self._thread(lambda: self._made().reset(record), "reset")

    async def _step(self, action: str, step_index: int) -> Any:
        assert self._environment is not None
        environment = self._environment
        return await self._thread(lambda: environment.step(action), f"step{step_index}")

    async def _close(self) -> None:
        if self.failure is not None and self.failure.reason == "timeout":
            return  # an abandoned thread may still be inside the environment; leave it alone
        close = getattr(self._environment, "close", None)
        if callable(close):
            await self._thread(close, "close")


# --- Sources -------------------------------------------------------------------------------------


class EnvironmentSource(ABC):
    """What `--task env:...` names: episodes to play and the records they play on.

    Records are JSON-able dicts with a unique string "id". `train_records(seed)` is endless and
    deterministic given the seed; `eval_records(n)` is held out: none of its ids is ever yielded by
    `train_records` (checked for every training record once `eval_records` has been called).
    """

    name: str

    @abstractmethod
    def new_episode(self, episode_id: str) -> AsyncEpisodeEnv:
        """A fresh episode (not yet reset)."""

    @abstractmethod
    def _train_records(self, seed: int) -> Iterator[dict]: ...

    @abstractmethod
    def _eval_records(self, n: int) -> list[dict]: ...

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name, self.seed = name, seed
        self._eval_ids: set[str] = set()

    def train_records(self, seed: int | None = None) -> Iterator[dict]:
        """The endless training stream (the source's seed when `seed` is None)."""
        where = f"{self.name}: train_records"
        count = 0
        for record in self._train_records(self.seed if seed is None else seed):
            check_record(record, f"{where} record {count}")
            if record["id"] in self._eval_ids:
                raise ValueError(f"{where}: record id {record['id']!r} is also a held-out (eval) record")
            count += 1
            yield record
        raise ValueError(f"{where}: the stream ended after {count} records (it must be endless)")

    def eval_records(self, n: int) -> list[dict]:
        """`n` held-out records (fewer if the environment has fewer), the same at every seed."""
        if n <= 0:
            raise ValueError(f"n: must be > 0, got {n}")
        records = list(self._eval_records(n))[:n]
        seen: set[str] = set()
        for i, record in enumerate(records):
            check_record(record, f"{self.name}: eval_records record {i}")
            if record["id"] in seen:
                raise ValueError(f"{self.name}: eval_records: duplicate id {record['id']!r}")
            seen.add(record["id"])
        self._eval_ids |= seen
        return records

    async def close(self) -> None:
        """Frees what the source holds (a remote source's channels); episodes close themselves."""
        return None


def check_record(record: object, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a dict, got {type(record).__name__}")
    if not isinstance(record.get("id"), str) or not record["id"]:
        raise ValueError(f"{where}: needs a non-empty string 'id', got {record.get('id')!r}")


class LocalSource(EnvironmentSource):
    """Episodes of a Python environment: `make()` per episode, records from two callables."""

    def __init__(
        self,
        name: str,
        make: Callable[[], Environment],
        train_records: Callable[[int], Iterator[dict]],
        eval_records: Callable[[int], list[dict]],
        *,
        seed: int = 0,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
    ) -> None:
        super().__init__(name, seed)
        self.make, self._train, self._eval = make, train_records, eval_records
        self.step_timeout_s, self.max_observation_chars = step_timeout_s, max_observation_chars

    def new_episode(self, episode_id: str) -> LocalEnv:
        return LocalEnv(
            self.make,
            name=self.name,
            episode_id=episode_id,
            step_timeout_s=self.step_timeout_s,
            max_observation_chars=self.max_observation_chars,
        )

    def _train_records(self, seed: int) -> Iterator[dict]:
        return iter(self._train(seed))

    def _eval_records(self, n: int) -> list[dict]:
        return list(self._eval(n))
