"""Rewards: what `task.reward` names, built into one `Scorer` (rollout/rewards/scorer.py).

`task.reward` is a comma-separated list of components, each `[WEIGHT*]SPEC`; the reward is their
weighted sum. Empty means the task's own reward (weight 1). SPEC is one of:
  task                    the task's own `reward(prompt, completion)`
  exact | last_integer | math_verify      built in (rollout/rewards/builtin.py)
  package.module:function a user function (prompt, completion, answer, metadata) -> float
  grpc:HOST:PORT          a parity.v1.RewardService (rollout/rewards/remote.py)
Examples: `math_verify`, `0.8*math_verify,0.2*my_rewards:brevity`, `grpc:127.0.0.1:50070`.
Every spec is resolved when the scorer is built (start-up); a bad one raises `TaskError` naming
`task.reward`. A remote service is not called until the first group is scored.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rollout.tasks import Task, TaskError

if TYPE_CHECKING:
    from parity.config.task import TaskConfig
    from rollout.rewards.scorer import Component, Scorer


def parse_reward(spec: str) -> list[tuple[float, str]]:
    """`task.reward` -> [(weight, SPEC)]; empty -> [(1.0, "task")]."""
    components = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            continue
        weight_text, star, name = part.partition("*")
        if not star:
            weight, name = 1.0, part
        else:
            try:
                weight = float(weight_text)
            except ValueError:
                raise TaskError(f"task.reward: weight {weight_text!r} in {part!r} is not a number") from None
            if not math.isfinite(weight):
                raise TaskError(f"task.reward: weight in {part!r} must be finite")
        if not name.strip():
            raise TaskError(f"task.reward: empty reward in {spec!r}")
        components.append((weight, name.strip()))
    return components or [(1.0, "task")]


def _component(weight: float, name: str, task: Task, config: TaskConfig) -> Component:
    from rollout.rewards.builtin import BUILTIN
    from rollout.rewards.scorer import Component

    if name == "task":
        return Component(weight, f"task:{task.name}", task=task)
    if name in BUILTIN:
        if name == "math_verify":
            try:
                import math_verify  # noqa: F401
            except ImportError:
                raise TaskError(
                    "task.reward: math_verify needs the `math-verify` package (pip install 'parity[tasks]')"
                ) from None
        return Component(weight, name, BUILTIN[name])
    if name.startswith("grpc:"):
        from rollout.rewards.remote import RemoteReward

        address = name.removeprefix("grpc:")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise TaskError(f"task.reward: expected grpc:HOST:PORT, got {name!r}")
        remote = RemoteReward(address, config.reward_timeout_s, config.reward_retries)
        return Component(weight, name, remote=remote)
    if ":" in name:
        from rollout.tasks.loading import load_object

        function = load_object(name, "task.reward")
        if not callable(function):
            raise TaskError(f"task.reward: {name} is not callable")
        return Component(weight, name, function)  # type: ignore[arg-type]
    raise TaskError(
        f"task.reward: unknown reward {name!r}; choose task, exact, last_integer, math_verify, "
        "package.module:function or grpc:HOST:PORT"
    )


def build_scorer(task: Task, config: TaskConfig) -> Scorer:
    """The scorer of `task.reward` for `task` (module docstring)."""
    from rollout.rewards.scorer import Scorer

    return Scorer(
        [_component(w, n, task, config) for w, n in parse_reward(config.reward)],
        task.name,
        config.reward_timeout_s,
    )
