"""An environment as a task: `--task env:...` gives the actor records to start episodes from.

Each training prompt wraps one environment record (`Prompt.metadata`); its text is the record's
`question` when it has one, for logs and tables, while the episode's first user message is whatever
`reset(record)` returns. Held-out prompts are the source's `eval_records`, disjoint from training by
id. The reward of an environment task is the episode's return, never `reward(prompt, text)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from rollout.environments.base import EnvironmentSource
from rollout.tasks.base import Prompt, TaskError


def record_prompt(record: dict) -> Prompt:
    text = record.get("question") or json.dumps(record, sort_keys=True)
    return Prompt(
        prompt_id=str(record["id"]), text=str(text), answer=str(record.get("answer", "")), metadata=record
    )


class EnvironmentTask:
    """The Task protocol over an EnvironmentSource (rollout/tasks/base.py)."""

    is_environment = True

    def __init__(self, source: EnvironmentSource) -> None:
        self.source = source
        self.name = source.name

    def train_prompts(self) -> Iterator[Prompt]:
        for record in self.source.train_records():
            yield record_prompt(record)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return [record_prompt(r) for r in self.source.eval_records(n)]

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        raise TaskError(f"task.name: {self.name} is an environment: its rewards come from episodes")


def environment_task(spec: str, seed: int, config) -> EnvironmentTask:
    from rollout.environments.loading import get_environment

    return EnvironmentTask(get_environment(spec, seed, config))
