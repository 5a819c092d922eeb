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

from rollout.tasks.base import Prompt, TaskError
from rollout.tasks.records import check_unique_ids, to_prompt

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
