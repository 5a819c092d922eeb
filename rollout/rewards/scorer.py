"""Scoring a group off the actor's event loop, with a deadline, and failing loudly, never as 0.

    scorer = build_scorer(task, config.task)            # rollout/rewards/__init__.py
    rewards = await scorer.score(prompt, completions, request_id=group_id)
    # -> one finite float per completion, or RewardFailed(kind, reason): drop the group

Invariants:
  - The event loop never runs reward code: a Python reward (built-in, `package.module:function`, the
    task's own) runs in a daemon thread and is awaited with a timeout (`timeout_s` per group); a
    remote reward is an async gRPC call with a deadline (rollout/rewards/remote.py).
  - A reward that raises, times out or returns a non-finite value fails the whole group:
    `RewardFailed.kind` is "error", "timeout" or "non_finite" and `reason` says which reward and why.
    The caller drops the group and counts it; no score is invented in its place.
  - A timed-out Python reward cannot be killed; its thread is a daemon (it never holds the process
    open) and keeps counting until it returns: at most `MAX_STUCK_THREADS` reward calls run at once,
    stuck ones included; past that every call fails with kind "timeout" at once, rather than piling
    up threads.
  - Weighted components: the reward is sum(weight * component); a component failing fails the sum.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.tasks import Prompt

MAX_STUCK_THREADS = 32


class RewardFailed(Exception):
    """A group's reward could not be computed; `kind` is error | timeout | non_finite."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


_stuck = 0
_stuck_lock = threading.Lock()


async def run_off_loop(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """`fn()` in a daemon thread, awaited for at most `timeout_s` (module docstring)."""
    global _stuck
    with _stuck_lock:
        if _stuck >= MAX_STUCK_THREADS:
            raise RewardFailed(
                "timeout", f"{name}: {_stuck} earlier calls are still stuck; not calling again"
            )
        _stuck += 1
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        global _stuck
        try:
            result, ok = fn(), True
        except BaseException as exc:  # handed to the awaiting coroutine, which reports it
            result, ok = exc, False
        with _stuck_lock:
            _stuck -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed while this call ran past its timeout
            loop.call_soon_threadsafe(deliver, ok, result)

    threading.Thread(target=target, name=f"reward:{name}", daemon=True).start()
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        raise RewardFailed("timeout", f"{name}: no result within {timeout_s:g}s") from None


@dataclass(frozen=True)
class Component:
    weight: float
    name: str
    # A Python reward (prompt, completion, answer, metadata) -> float, or a RemoteReward.
    function: Callable[[str, str, str, Any], float] | None = None
    remote: Any = None
    # The task itself: its reward(prompt, completion).
    task: Any = None


class Scorer:
    """The task's reward, as configured by `task.reward` (rollout/rewards/__init__.py)."""

    def __init__(self, components: Sequence[Component], task_name: str, timeout_s: float) -> None:
        self.components = list(components)
        self.task_name, self.timeout_s = task_name, timeout_s
        self.name = "+".join(c.name if c.weight == 1 else f"{c.weight:g}*{c.name}" for c in self.components)

    async def _component(
        self, c: Component, prompt: Prompt, completions: Sequence[str], rid: str
    ) -> list[float]:
        if c.remote is not None:
            return await c.remote.score(prompt, completions, self.task_name, rid)

        def call_all() -> list[float]:
            if c.task is not None:
                return [float(c.task.reward(prompt, text)) for text in completions]
            return [
                float(c.function(prompt.text, text, prompt.answer, prompt.metadata)) for text in completions
            ]

        try:
            return await run_off_loop(call_all, self.timeout_s, c.name)
        except RewardFailed:
            raise
        except Exception as exc:
            raise RewardFailed("error", f"{c.name}: {type(exc).__name__}: {exc}") from exc

    async def score(self, prompt: Prompt, completions: Sequence[str], request_id: str = "") -> list[float]:
        """One finite reward per completion, or RewardFailed (module docstring)."""
        parts = await asyncio.gather(
            *(self._component(c, prompt, completions, request_id) for c in self.components),
            return_exceptions=True,
        )
        for part in parts:
            if isinstance(part, BaseException):
                if isinstance(part, RewardFailed):
                    raise part
                raise RewardFailed("error", f"{type(part).__name__}: {part}") from part
        totals = [0.0] * len(completions)
        for c, values in zip(self.components, parts, strict=True):
            for i, value in enumerate(values):
                if not math.isfinite(value):
                    raise RewardFailed("non_finite", f"{c.name}: returned {value!r} for completion {i}")
                totals[i] += c.weight * value
        return totals

    def score_all_sync(
        self, batches: Sequence[tuple[Prompt, Sequence[str]]], concurrency: int = 8
    ) -> list[list[float] | RewardFailed]:
        """`score` over many (prompt, completions) batches for callers without an event loop
        (held-out evaluation): one loop, at most `concurrency` batches at once; a failed batch is its
        RewardFailed in the result, in place."""

        async def run_all() -> list[list[float] | RewardFailed]:
            limit = asyncio.Semaphore(concurrency)

            async def one(i: int, prompt: Prompt, completions: Sequence[str]) -> list[float] | RewardFailed:
                async with limit:
                    try:
                        return await self.score(prompt, completions, request_id=f"eval-{i}")
                    except RewardFailed as exc:
                        return exc

            try:
                return list(await asyncio.gather(*(one(i, p, c) for i, (p, c) in enumerate(batches))))
            finally:
                await self.close()

        return asyncio.run(run_all())

    async def close(self) -> None:
        for c in self.components:
            if c.remote is not None:
                await c.remote.close()
