"""Tasks: where the actor's prompts come from and how completions are rewarded.

A task is pluggable: anything with `name`, `train_prompts()`, `eval_prompts(n)` and `reward()`.
Invariants every task keeps:
  - `train_prompts()` is endless and deterministic given the seed;
  - `eval_prompts(n)` is held out: no eval prompt text ever appears in the training stream;
  - `reward()` is verifiable (computed from the text alone) and lies in [0, 1].
Prompt text is the user's turn; the rollout service applies the model's chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str


class Task(Protocol):
    name: str

    def train_prompts(self) -> Iterator[Prompt]:
        """Endless, deterministic given the seed."""

    def eval_prompts(self, n: int) -> list[Prompt]:
        """Held-out prompts, disjoint from the training stream."""

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Verifiable reward in [0, 1]."""


def _arithmetic(seed: int) -> Task:
    from rollout.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask(seed=seed)


def _arithmetic_final(seed: int) -> Task:
    from rollout.tasks.arithmetic import FinalAnswerArithmeticTask

    return FinalAnswerArithmeticTask(seed=seed)


TASKS: dict[str, Callable[[int], Task]] = {"arithmetic": _arithmetic, "arithmetic_final": _arithmetic_final}


def get_task(name: str, seed: int = 0) -> Task:
    """A built-in task by name; an unknown name raises ValueError naming the field `task`."""
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}")
    return TASKS[name](seed)
