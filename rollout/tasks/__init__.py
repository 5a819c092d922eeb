"""Tasks: where the actor's prompts come from and how completions are rewarded.

A task is pluggable: anything with `name`, `train_prompts()`, `eval_prompts(n)` and `reward()`.
Invariants every task keeps:
  - `train_prompts()` is endless and deterministic given the seed;
  - `eval_prompts(n)` is held out: no eval prompt (by id or by text) ever appears in training;
  - `reward()` is verifiable (computed from the text alone) and lies in [0, 1].
A finite task (a data set) also has `train_set()`, the training prompts in a fixed order; the
actor's `rollout.tasks.stream.PromptStream` then walks it in epochs, partitioned across the fleet.

Sources, chosen by `task.name` (the `--task` flag; docs/tasks.md):
  arithmetic | arithmetic_final      built in (rollout/tasks/arithmetic.py)
  jsonl:PATH                         rollout/tasks/jsonl.py
  hf:PATH[:split]                    rollout/tasks/hf.py (a dataset on disk, via `datasets`)
  reasoning_gym:NAME[,NAME...]       rollout/tasks/reasoning_gym_task.py
  package.module:factory             rollout/tasks/loading.py (any object implementing Task)
  env:NAME | env:pkg.mod:factory | env:grpc:HOST:PORT
                                     multi-turn environments (rollout/environments/, docs/environments.md)
Prompt text is the user's turn; the rollout service applies the model's chat template unless
`task.chat_template` is off (rollout/tasks/chat.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout.tasks.base import FiniteTask, Prompt, Task, TaskError

if TYPE_CHECKING:
    from parity.config.task import TaskConfig

__all__ = ["TASKS", "FiniteTask", "Prompt", "Task", "TaskError", "get_task"]


def _arithmetic(seed: int) -> Task:
    from rollout.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask(seed=seed)


def _arithmetic_final(seed: int) -> Task:
    from rollout.tasks.arithmetic import FinalAnswerArithmeticTask

    return FinalAnswerArithmeticTask(seed=seed)


TASKS: dict[str, Callable[[int], Task]] = {"arithmetic": _arithmetic, "arithmetic_final": _arithmetic_final}


def get_task(name: str, seed: int = 0, config: TaskConfig | None = None) -> Task:
    """The task that `task.name` names (see the module docstring); errors name the field `task.name`.

    `config` carries the source options (held-out set, field names, data set size); its defaults
    apply when it is None. Data sets are read and validated here, so a bad file fails at start-up.
    """
    from parity.config.task import TaskConfig

    config = config or TaskConfig()
    if name in TASKS:
        return TASKS[name](seed)
    if name.startswith("jsonl:"):
        from rollout.tasks.sources import jsonl_task

        return jsonl_task(name.removeprefix("jsonl:"), config)
    if name.startswith("hf:"):
        from rollout.tasks.sources import hf_task

        return hf_task(name.removeprefix("hf:"), config)
    if name.startswith("env:"):
        from rollout.environments.task import environment_task

        return environment_task(name, seed, config)
    if name.startswith("reasoning_gym:"):
        from rollout.tasks.reasoning_gym_task import reasoning_gym_task

        return reasoning_gym_task(name.removeprefix("reasoning_gym:"), seed, config)
    if ":" in name:
        from rollout.tasks.loading import module_task

        return module_task(name, seed)
    raise TaskError(
        f"task: unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}, or a source "
        "jsonl:PATH, hf:PATH[:split], reasoning_gym:NAME[,NAME], package.module:factory"
    )
