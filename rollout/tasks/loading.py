"""`package.module:attr`: import a user's object by name (tasks here, rewards in rollout.rewards).

Invariants: the module is imported with the normal import system (the current directory is on
`sys.path`, as for `python -m`); a missing module or attribute raises `TaskError` naming the config
key; a task object must have `name`, `train_prompts`, `eval_prompts` and `reward`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from rollout.tasks.base import Task, TaskError

TASK_METHODS = ("train_prompts", "eval_prompts", "reward")


def load_object(spec: str, key: str) -> object:
    """The object that `package.module:attr` names; errors name `key`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"{key}: expected package.module:attr, got {spec!r}")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"{key}: cannot import {module_name!r} ({exc})") from None
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise TaskError(f"{key}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def module_task(spec: str, seed: int) -> Task:
    """A Task instance, or a factory called with `seed=` that returns one."""
    target = load_object(spec, "task.name")
    task = target if all(hasattr(target, m) for m in TASK_METHODS) else None
    if task is None and callable(target):
        task = target(seed=seed)
    missing = [m for m in (*TASK_METHODS, "name") if not hasattr(task, m)]
    if missing:
        raise TaskError(f"task.name: {spec} did not give a Task (missing {', '.join(missing)})")
    return task  # type: ignore[return-value]
