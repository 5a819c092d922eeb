"""`jsonl:PATH` and `hf:PATH[:split]` tasks: the records a reader returns (rollout/tasks/jsonl.py,
rollout/tasks/hf.py), split into train and held-out prompts (rollout/tasks/records.py).

Invariants:
  - The held-out set is `task.eval_task` (jsonl:PATH or hf:PATH[:split], read and validated like the
    task itself) when set, else a fixed `task.eval_fraction` of the task's own records.
  - The readers never import one another or this module: each source is one reader, and this module
    is the only place that knows both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollout.tasks.base import Prompt, TaskError
from rollout.tasks.jsonl import read_jsonl
from rollout.tasks.records import DatasetTask, split_held_out

if TYPE_CHECKING:
    from parity.config.task import TaskConfig


def held_out_records(config: TaskConfig) -> list[Prompt] | None:
    """The records of `task.eval_task` (jsonl:PATH or hf:PATH[:split]), or None to split by fraction."""
    spec = config.eval_task
    if not spec:
        return None
    if spec.startswith("jsonl:"):
        return read_jsonl(spec.removeprefix("jsonl:"), config)
    if spec.startswith("hf:"):
        from rollout.tasks.hf import read_hf

        return read_hf(spec.removeprefix("hf:"), config)
    raise TaskError(f"task.eval_task: must be jsonl:PATH or hf:PATH[:split], got {spec!r}")


def jsonl_task(path: str, config: TaskConfig) -> DatasetTask:
    prompts = read_jsonl(path, config)
    train, evals = split_held_out(prompts, held_out_records(config), config.eval_fraction, f"jsonl:{path}")
    return DatasetTask(f"jsonl:{Path(path).name}", train, evals)


def hf_task(spec: str, config: TaskConfig) -> DatasetTask:
    from rollout.tasks.hf import read_hf, split_spec

    prompts = read_hf(spec, config)
    train, evals = split_held_out(prompts, held_out_records(config), config.eval_fraction, f"hf:{spec}")
    return DatasetTask(f"hf:{Path(split_spec(spec)[0]).name}", train, evals)
