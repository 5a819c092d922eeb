"""Atomic checkpoints: weights + optimizer state + version + consumer/dedupe state, together.

Layout: run_dir/checkpoints/step_00000012/{model.safetensors, optimizer.safetensors, state.json}
and run_dir/checkpoints/LATEST naming the newest complete one.

Atomicity (a kill -9 at any moment leaves either the old or the new checkpoint, never a mix):
1. everything is written into `.tmp-step_N/`, each file fsynced;
2. the directory is renamed to `step_N/` (atomic on one filesystem) and the parent fsynced;
3. LATEST is replaced atomically (write tmp + fsync + rename).
A reader trusts LATEST, and falls back to the newest `step_*` with a state.json if LATEST is
missing. The dedupe set lives here (not in Redis) because it must describe exactly the updates
contained in these weights: a rollout applied after this checkpoint is lost with the process and
must be trained again after the restart.

No pickle: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import json
import os
import shutil
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
    applied_rollout_ids: list[str] = field(default_factory=list)
    rollouts_trained_total: int = 0
    dropped_stale_total: int = 0
    duplicates_skipped_total: int = 0
    zero_variance_groups_total: int = 0
    malformed_total: int = 0

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


def _optimizer_to_flat(optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {"param_groups": state_dict["param_groups"], "state": {}}
    for index, per_param in state_dict["state"].items():
        scalars["state"][str(index)] = {}
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars["state"][str(index)][name] = value
    return tensors, scalars


def _optimizer_from_flat(optimizer, tensors: dict, scalars: dict) -> None:
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in scalars["state"].items()}
    for key, tensor in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": scalars["param_groups"]})


class CheckpointStore:
    """Save/restore trainer checkpoints under run_dir/checkpoints."""

    def __init__(self, run_dir: str | Path, keep: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def save(self, model, optimizer, state: TrainerState) -> Path:
        from safetensors.torch import save_file, save_model

        name = f"step_{state.step:08d}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(model, str(tmp / "model.safetensors"))
        tensors, scalars = _optimizer_to_flat(optimizer)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(scalars))
        (tmp / "state.json").write_text(state.to_json())
        for path in tmp.iterdir():
            _fsync_file(path)
        _fsync_dir(tmp)
        if final.exists():  # same step saved twice (e.g. a requested + final checkpoint)
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, name)
        self._prune(keep_name=name)
        return final

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if pointer.exists():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / "state.json").exists():
                return candidate
        complete = sorted(p for p in self.root.glob("step_*") if (p / "state.json").exists())
        return complete[-1] if complete else None

    def load(self, model, optimizer, path: Path | None = None) -> TrainerState | None:
        """Restore weights and optimizer in place; None when there is no checkpoint."""
        from safetensors.torch import load_file, load_model

        path = path or self.latest()
        if path is None:
            return None
        load_model(model, str(path / "model.safetensors"))
        if optimizer is not None:
            scalars = json.loads((path / "optimizer.json").read_text())
            _optimizer_from_flat(optimizer, load_file(str(path / "optimizer.safetensors")), scalars)
        return TrainerState.from_json((path / "state.json").read_text())

    def _prune(self, keep_name: str) -> None:
        complete = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in complete[: max(0, len(complete) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)
        for stale_tmp in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale_tmp, ignore_errors=True)
