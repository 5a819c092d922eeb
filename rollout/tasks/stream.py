"""The prompt stream: the one place that decides which training prompt a rollout worker draws next.

    stream = PromptStream(task, seed=run.seed, worker_index=i, num_workers=n)
    prompt = stream.next()          # position counts this worker's draws: 0, 1, 2, ...
    saved = stream.position         # a checkpoint keeps this integer (and nothing else)
    ...
    stream = PromptStream(task, seed=run.seed, worker_index=i, num_workers=n)
    stream.seek(saved)              # the next draw is the one that followed `saved` draws

Invariants:
  - Deterministic: the prompt at a position depends only on (task, seed, worker_index, num_workers,
    position). `seek(p)` then `next()` gives exactly what the p-th draw of a fresh stream gave, so a
    restarted worker resumes where it stopped, neither repeating nor skipping prompts.
  - Finite tasks (`train_set()`, a data set of N prompts): epoch e visits the set in the order of
    a permutation drawn from `seed` and `e` (the same on every worker); worker w takes the entries at
    permutation positions w, w + n, w + 2n, ... of every epoch. Across the fleet every training prompt
    is drawn exactly once per epoch, with no duplicates; `epoch` says which epoch this worker is in.
    A worker's epoch is `position // share` (its share is ceil((N - w) / n)); workers that draw at
    different rates can be in different epochs, each still covering its own share once per epoch.
  - Endless tasks (only `train_prompts()`, e.g. the built-in arithmetic, which samples with
    replacement): the task's one seeded stream is dealt round robin, draw w, w + n, ... to worker w.
    With one worker this is the task's own stream. `seek(p)` replays it, so it costs O(p * n) draws of
    the task's generator (microseconds each for the built-ins); `epoch` is None (there are none).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from rollout.tasks.base import FiniteTask, Prompt, Task, TaskError


class PromptStream:
    """This worker's training prompts, in order (module docstring)."""

    def __init__(self, task: Task, seed: int = 0, worker_index: int = 0, num_workers: int = 1) -> None:
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise TaskError(
                f"rollout.worker_index: must be in [0, run.rollout_workers={num_workers}), got {worker_index}"
            )
        self.task, self.seed = task, seed
        self.worker_index, self.num_workers = worker_index, num_workers
        self._position = 0
        self._finite = isinstance(task, FiniteTask)
        if self._finite:
            self._set = list(task.train_set())  # type: ignore[union-attr]
            if len(self._set) < num_workers:
                raise TaskError(
                    f"task.name: {task.name} has {len(self._set)} training prompts, fewer than "
                    f"run.rollout_workers={num_workers}: some worker would have none"
                )
            self._share = len(range(worker_index, len(self._set), num_workers))
            self._epoch_order: tuple[int, list[int]] | None = None
        else:
            self._endless: Iterator[Prompt] = self._dealt()

    @property
    def position(self) -> int:
        """Draws this worker has taken so far (the next draw is number `position`)."""
        return self._position

    @property
    def epoch(self) -> int | None:
        """The epoch of the next draw for a finite task; None for an endless one."""
        return self._position // self._share if self._finite else None

    def seek(self, position: int) -> None:
        """Make the next draw the one a fresh stream gives after `position` draws."""
        if position < 0:
            raise ValueError(f"position: must be >= 0, got {position}")
        self._position = position
        if not self._finite:
            self._endless = itertools.islice(self._dealt(), position, None)

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Prompt:
        return self.next()

    def next(self) -> Prompt:
        if self._finite:
            epoch, offset = divmod(self._position, self._share)
            prompt = self._set[self._order(epoch)[self.worker_index + offset * self.num_workers]]
        else:
            prompt = next(self._endless)
        self._position += 1
        return prompt

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(range(len(self._set)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)  # str seeds hash stably (sha512)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def _dealt(self) -> Iterator[Prompt]:
        return itertools.islice(self.task.train_prompts(), self.worker_index, None, self.num_workers)
