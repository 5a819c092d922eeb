"""The task types: a prompt, the Task protocol every source implements, and the error a bad source raises.

Here, not in rollout/tasks/__init__.py, so that the sources import these without importing the
registry (`get_task`) that imports them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str
    # Chat turns (role, content) when the record came as `messages`; `text` then renders them.
    messages: tuple[tuple[str, str], ...] = ()
    # The record's own fields (reasoning-gym entries, user metadata), handed to rewards.
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)


class Task(Protocol):
    name: str

    def train_prompts(self) -> Iterator[Prompt]:
        """Endless, deterministic given the seed."""

    def eval_prompts(self, n: int) -> list[Prompt]:
        """Held-out prompts, disjoint from the training stream."""

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Verifiable reward in [0, 1]."""


@runtime_checkable
class FiniteTask(Protocol):
    """A task backed by a data set: the stream walks `train_set()` in epochs (rollout/tasks/stream.py)."""

    name: str

    def train_set(self) -> Sequence[Prompt]:
        """Every training prompt once, in a fixed order (the stream shuffles per epoch)."""


class TaskError(ValueError):
    """A task source is unusable; the message names the config key, the file and the line or field."""
