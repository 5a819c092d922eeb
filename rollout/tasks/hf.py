"""`hf:PATH[:split]`: a task from a data set on disk, read with the `datasets` library.

PATH is a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a local data
file (.json/.jsonl/.csv/.parquet/.arrow). There is no hub access at run time: a PATH that is not on
disk is an error, never a download. Columns map to records with `task.prompt_field`,
`task.answer_field` and `task.id_field` (rollout/tasks/records.py), and every row is validated when
the task is built, errors naming `PATH[split] row N` and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollout.tasks.base import Prompt, TaskError
from rollout.tasks.records import check_unique_ids, to_prompt

if TYPE_CHECKING:
    from parity.config.task import TaskConfig

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def split_spec(spec: str) -> tuple[str, str]:
    """`PATH[:split]` -> (PATH, split or ""); a PATH that exists on disk keeps its colons."""
    path, sep, split = spec.rpartition(":")
    if sep and path and "/" not in split and not Path(spec).exists():
        return path, split
    return spec, ""


def _load(path: str, split: str):
    try:
        import datasets
    except ImportError:
        raise TaskError("task.name: hf: needs the `datasets` package (pip install 'parity[tasks]')") from None
    local = Path(path)
    if not local.exists():
        raise TaskError(f"task.name: hf:{path}: no such file or directory (datasets are read from disk only)")
    if local.is_dir():
        loaded = datasets.load_from_disk(str(local))
    elif local.suffix in FILE_BUILDERS:
        loaded = datasets.load_dataset(FILE_BUILDERS[local.suffix], data_files=str(local))
    else:
        raise TaskError(f"task.name: hf:{path}: expected a save_to_disk directory or {sorted(FILE_BUILDERS)}")
    if isinstance(loaded, datasets.DatasetDict):
        if not split:
            split = "train" if "train" in loaded else next(iter(loaded))
        if split not in loaded:
            raise TaskError(f"task.name: hf:{path}: no split {split!r}; splits: {', '.join(loaded)}")
        return loaded[split], split
    if split:
        raise TaskError(f"task.name: hf:{path}: a single Dataset has no split {split!r}")
    return loaded, ""


def read_hf(spec: str, config: TaskConfig) -> list[Prompt]:
    path, split = split_spec(spec)
    rows, split = _load(path, split)
    label = f"{path}[{split}]" if split else path
    placed = []
    for index, row in enumerate(rows):
        where = f"{label} row {index}"
        placed.append((where, to_prompt(row, where, f"{Path(path).name}-{split or 'all'}-{index}", config)))
    if not placed:
        raise TaskError(f"{label}: no rows")
    check_unique_ids(placed)
    return [prompt for _, prompt in placed]
