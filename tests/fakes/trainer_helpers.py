"""An in-process trainer on the tiny model and a real Redis stream, and readers of its run dir,
shared by the trainer-loop tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import config_for
from trainer.loop import Trainer

STREAM = "test:rollouts"


def make_trainer(redis_url: str, run_dir: Path, **overrides) -> Trainer:
    """A set-up Trainer: one small step on the test stream unless `overrides` say otherwise."""
    settings = {
        "model": "tiny",
        "redis_url": redis_url,
        "stream": STREAM,
        "run_dir": str(run_dir),
        "steps": 1,
        "groups_per_step": 1,
        "micro_batch_size": 4,
        "read_block_ms": 50,
        "claim_idle_ms": 200,
        **overrides,
    }
    trainer = Trainer(config_for("trainer", **settings))
    trainer.setup()
    return trainer


def metrics(run_dir: Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
