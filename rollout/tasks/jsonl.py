"""`jsonl:PATH`: a task from a JSON Lines file, one record per line (rollout/tasks/records.py).

Invariants:
  - The whole file is read and validated when the task is built; a line that is not JSON, or not a
    valid record, raises `TaskError` naming `PATH:LINE` and the field, before any process starts.
  - Blank lines are skipped; line numbers count from 1 as editors show them.
  - A relative PATH is taken from the current directory (`parity run` resolves it before its
    children change directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.tasks import Prompt, TaskError
from rollout.tasks.records import DatasetTask, check_unique_ids, split_held_out, to_prompt

if TYPE_CHECKING:
    from parity.config.task import TaskConfig


def read_jsonl(path: str, config: TaskConfig) -> list[Prompt]:
    """Every record of the file as a Prompt, validated (module docstring)."""
    file = Path(path)
    if not path:
        raise TaskError("task.name: jsonl: needs a path (jsonl:PATH)")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TaskError(f"task.name: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    placed: list[tuple[str, Prompt]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        placed.append((where, to_prompt(record, where, f"{file.stem}-{number}", config)))
    if not placed:
        raise TaskError(f"{path}: no records")
    check_unique_ids(placed)
    return [prompt for _, prompt in placed]


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
