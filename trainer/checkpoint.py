"""Atomic, sharded checkpoints: weights + optimizer + scheduler + RNG + version + consumer state.

Layout: run_dir/checkpoints/step_00000012/{dcp/, state.json, model.json} and
run_dir/checkpoints/LATEST naming the newest complete one. `dcp/` is a torch.distributed.checkpoint
(DCP) directory holding the model and AdamW state: each rank writes its own shards, and the
metadata describes global tensors, so a checkpoint written by N ranks loads on M ranks (or in one
unsharded process: `parity export`).

Atomicity (a kill -9 at any moment leaves either the old or the new checkpoint, never a mix):
1. every rank writes into `.tmp-step_N/` (collective); rank 0 adds state.json and fsyncs every file;
2. rank 0 renames the directory to `step_N/` (atomic on one filesystem) and fsyncs the parent;
3. LATEST is replaced atomically (write tmp + fsync + rename); then all ranks meet at a barrier.
A reader trusts LATEST, and falls back to the newest `step_*` with a state.json if LATEST is
missing. The dedupe ids live here (not in Redis) because they must describe exactly the updates
contained in these weights: a rollout applied after this checkpoint is lost with the process and
must be trained again after the restart.

state.json and model.json are JSON. DCP's own `.metadata` is torch's format (pickled); checkpoints
are read only from the run's own directory. Checkpoints of the earlier single-file layout
(model.safetensors + optimizer.safetensors) still load.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LATEST = "LATEST"


@dataclass
class TrainerState:
    """What, besides tensors, a checkpoint must restore."""

    step: int = 0
    weight_version: int = 0
    # Highest version number published so far (>= weight_version); new versions continue above it.
    published_version: int = 0
    # Stream entries below this id are reflected in these weights (or were dropped/duplicates).
    replay_floor: str = "0-0"
    # Rollout ids in these weights that a restart can still meet (see Trainer._bound_dedupe), and
    # the stream entry each came from (same order).
    applied_rollout_ids: list[str] = field(default_factory=list)
    applied_rollout_entries: list[str] = field(default_factory=list)
    rollouts_trained_total: int = 0
    # Steps skipped for a non-finite gradient, and their rollouts (acked, never trained).
    skipped_nonfinite_steps_total: int = 0
    rollouts_skipped_nonfinite_total: int = 0
    dropped_stale_total: int = 0
    duplicates_skipped_total: int = 0
    zero_variance_groups_total: int = 0
    malformed_total: int = 0
    # Versions published by an earlier process of this run that died before checkpointing them
    # ([first, last], inclusive): their weights are not in this lineage, so rollouts sampled from
    # them are dropped (dropped_future_version), never trained.
    lost_versions: list[list[int]] = field(default_factory=list)
    dropped_future_version_total: int = 0
    scheduler: dict[str, Any] = field(default_factory=dict)  # LR scheduler state_dict (JSON-safe)
    rng_cpu: str = ""  # base64 of torch.get_rng_state() on rank 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        raw = json.loads(text)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def _optimizer_from_flat(optimizer, tensors: dict, scalars: dict) -> None:
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in scalars["state"].items()}
    for key, tensor in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": scalars["param_groups"]})


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def _alone_without_warning() -> Iterator[None]:
    """DCP in one process without a process group reads and writes alone, as meant here; it warns
    that it assumed so on every call (even when told with `no_dist`), which only worries a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def capture_rng(state: TrainerState) -> None:
    import torch

    state.rng_cpu = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def restore_rng(state: TrainerState) -> None:
    import numpy as np
    import torch

    if state.rng_cpu:
        raw = np.frombuffer(base64.b64decode(state.rng_cpu), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))


def load_model_weights(model, path: Path) -> None:
    """Only the weights of a checkpoint into an unsharded HF model (export, tests)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if (path / "model.safetensors").exists():  # the earlier single-file layout
        from safetensors.torch import load_model

        load_model(model, str(path / "model.safetensors"))
        return
    state = {"model": get_model_state_dict(model)}
    with _alone_without_warning():
        dcp.load(state, checkpoint_id=str(path / "dcp"), planner=_partial_load_planner())
    set_model_state_dict(model, state["model"])


def _partial_load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    return DefaultLoadPlanner(allow_partial_load=True)


class CheckpointStore:
    """Save/restore trainer checkpoints under run_dir/checkpoints (collective when distributed:
    every rank calls save/load with its own shards)."""

    def __init__(self, run_dir: str | Path, keep: int = 2, model_source: str = "") -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.model_source = model_source  # the base model directory (config + tokenizer for export)

    def save(self, model, optimizer, state: TrainerState, scheduler=None) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        name = f"step_{state.step:08d}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}"
        rank = _rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _alone_without_warning():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        _barrier()  # every shard is written
        if rank == 0:
            if scheduler is not None:
                state.scheduler = _json_safe(scheduler.state_dict())
            capture_rng(state)
            (tmp / "state.json").write_text(state.to_json())
            (tmp / "model.json").write_text(json.dumps({"model": self.model_source}))
            _fsync_tree(tmp)
            if final.exists():  # same step saved twice (e.g. a requested + final checkpoint)
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.root)
            atomic_write_text(self.root / LATEST, name)
            self._prune(keep_name=name)
        _barrier()
        return final

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if pointer.exists():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / "state.json").exists():
                return candidate
        complete = sorted(p for p in self.root.glob("step_*") if (p / "state.json").exists())
        return complete[-1] if complete else None

    def load(self, model, optimizer, path: Path | None = None, scheduler=None) -> TrainerState | None:
        """Restore weights, optimizer, scheduler and RNG in place; None when there is no checkpoint."""
        path = path or self.latest()
        if path is None:
            return None
        state = TrainerState.from_json((path / "state.json").read_text())
        if (path / "model.safetensors").exists():
            self._load_single_file(model, optimizer, path)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            loaded = {"model": model_sd, "optim": optim_sd}
            with _alone_without_warning():
                dcp.load(loaded, checkpoint_id=str(path / "dcp"))
            set_state_dict(
                model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
            )
        if scheduler is not None and state.scheduler:
            scheduler.load_state_dict(state.scheduler)
        restore_rng(state)
        return state

    @staticmethod
    def _load_single_file(model, optimizer, path: Path) -> None:
        from safetensors.torch import load_file, load_model

        load_model(model, str(path / "model.safetensors"))
        if optimizer is not None:
            scalars = json.loads((path / "optimizer.json").read_text())
            _optimizer_from_flat(optimizer, load_file(str(path / "optimizer.safetensors")), scalars)

    def _prune(self, keep_name: str) -> None:
        complete = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in complete[: max(0, len(complete) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)
        for stale_tmp in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale_tmp, ignore_errors=True)


def _json_safe(value: Any) -> Any:
    """A scheduler state_dict without its callables (lr_lambdas of plain functions are None)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
