"""The `run` section: the schedule every process of a run shares, and the `parity run` launcher.

The schedule (seed, steps, mode, groups_per_step, max_lag, publish_every) and the rollout stream
(redis_url, stream) are read by the rollout actor and the trainer alike, which is why they live
here and not in either service's section: each is defined once. The launcher fields
(rollout_workers, out, preflight, timeouts) are read by `parity run` only.

The defaults are the laptop demo: SmolLM2-135M on arithmetic, sized to finish in about 10 minutes on
2 CPU cores (see docs/run.md for the measurement).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from parity.config.base import Section

RunMode = Literal["async", "sync"]
DEFAULT_STREAM = "parity:rollouts"
TRACKERS = ("tensorboard", "wandb", "mlflow", "none")


class RunConfig(Section):
    """What every process of a run agrees on, plus how `parity run` starts them."""

    # The schedule, shared by the actor and the trainer.
    seed: int = Field(
        0, ge=0, description="Seed for prompts, sampling (run.seed + worker index) and the trainer."
    )
    steps: int = Field(
        16, ge=1, le=100_000, description="Optimizer steps the trainer takes, counted across restarts."
    )
    mode: RunMode = Field(
        "async",
        description="async: generation overlaps training (PipelineRL). sync: generate -> train -> update.",
    )
    groups_per_step: int = Field(4, ge=1, le=1024, description="GRPO groups consumed per optimizer step.")
    max_lag: int = Field(
        2,
        ge=0,
        le=1000,
        description="Staleness bound in versions: the async actor pauses while the backlog is "
        "max_lag * groups_per_step; the trainer drops entries whose oldest token is further behind.",
    )
    publish_every: int = Field(1, ge=1, le=10_000, description="Publish new weights every N steps.")
    redis_url: str = Field(
        "",
        description="Redis holding the rollout stream (redis://, rediss:// or unix://). Empty: `parity run` "
        "starts a private redis-server; the services require one.",
    )
    stream: str = Field(DEFAULT_STREAM, min_length=1, description="Redis stream key of RolloutGroup entries.")

    # The launcher.
    rollout_workers: int = Field(1, ge=1, le=16, description="Rollout services (one vLLM engine each).")
    out: str = Field("", description="Run directory; default runs/<UTC timestamp>.")
    skip_preflight: bool = Field(False, description="Do not run the rollout-vs-trainer mismatch check.")
    i_know_the_mismatch_is_high: bool = Field(
        False, description="Run even when the preflight check fails (it is still run and recorded)."
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Seconds each service may take to report SERVING."
    )
    step_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Abort when no optimizer step lands for this many seconds, or when the rollout "
        "services have not reached the final version this long after the last step.",
    )
    progress_interval_s: float = Field(
        10.0, gt=0, description="Seconds between progress lines when no step lands."
    )
    resume: str = Field(
        "",
        description="Resume the killed or finished run in this directory from its last checkpoint, with "
        "its config.toml (docs/run.md, 'Resuming a run').",
    )
    resume_override: bool = Field(
        False, description="With --resume: accept config values that differ from the run's config.toml."
    )
    tracker: str = Field(
        "none",
        description="Experiment trackers, comma-separated: tensorboard, wandb, mlflow, or none "
        "(install the `trackers` extra; docs/run.md, 'Trackers').",
    )

    @field_validator("tracker")
    @classmethod
    def _tracker(cls, value: str) -> str:
        names = [n.strip().lower() for n in value.split(",") if n.strip()]
        unknown = [n for n in names if n not in TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracker {', '.join(unknown)}; choose from {', '.join(TRACKERS)}")
        chosen = [n for n in TRACKERS if n in names and n != "none"]
        if "none" in names and chosen:
            raise ValueError("'none' cannot be combined with a tracker")
        return ",".join(chosen) or "none"

    def trackers(self) -> list[str]:
        """The chosen trackers, in a fixed order ([] for none)."""
        return [] if self.tracker == "none" else self.tracker.split(",")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value

    def run_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        return Path("runs") / dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")

    def worker_groups_per_step(self) -> int:
        """Groups each actor generates per version in sync mode (async actors share one backlog)."""
        if self.mode == "sync":
            return self.groups_per_step // self.rollout_workers
        return self.groups_per_step
