"""`parity run --resume RUN_DIR`: what a resumed run takes from its directory, and what it refuses.

A run killed at any moment (SIGKILL of the whole process tree, or of one child: the launcher then
stops the rest and exits 1) continues from its last trainer checkpoint:

1. **Config.** RUN_DIR/config.toml with the command line's flags (and PARITY_* variables) on top.
   A key whose value differs from the file is refused, naming every such key, unless
   `--resume_override`. Not compared: the values the launcher fills in per launch (service
   addresses, the run directory, the Redis URL, the stream name), the resume flags and
   `run.tracker` (trackers only watch; see commands/run/trackers.py).
2. **Redis.** The private redis-server restarts on its own data directory (RUN_DIR/logs/redis) with
   the password in its redis.conf (mode 0600), so it replays its append-only file: the stream, the
   consumer group with its pending entries, the replay floor and the actors' prompt positions
   continue. A run that used an external Redis (`--redis_url`) needs that URL again.
3. **Lineage files.** metrics.jsonl, trained_rollouts.jsonl and samples.jsonl are cut back to the
   checkpoint's step before anything reads them (the trainer does the same when it restores), so
   no step appears twice; the plots are drawn from the cut file.
4. **Versions.** The trainer starts before the rollout services. It restores the checkpoint and,
   since the restarted broadcast service holds no version, re-publishes the restored weights as
   the next number above the highest ever published; rollout services register afterwards and
   are caught up to that version before their actors generate. Rollouts in the stream sampled
   from versions published after the checkpoint are dropped and counted (dropped_future_version).
5. **Prompts.** Each actor continues after the highest prompt draw it published
   (parity.rollout_queue, "Producer positions"): the same prompts and seeds as an uninterrupted run.

What a kill can cost (the bound in docs/run.md): the steps trained after the checkpoint are
trained again from the stream (no rollout twice in the final lineage); prompts whose groups were in
flight (at most rollout.concurrency per worker in async mode) or were sampled from lost versions
(counted) are never trained.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from parity.config import ParityConfig, load
from parity.config.loader import CONFIG_FILE_ENV

# Filled in by the launcher per launch, or flags that only steer the launcher's bookkeeping.
NOT_COMPARED = frozenset(
    {
        "run.resume",
        "run.resume_override",
        "run.redis_url",
        "run.stream",
        "run.out",
        "run.tracker",
        "rollout.broadcast_address",
        "rollout.actor",
        "trainer.broadcast_address",
        "trainer.run_dir",
    }
)
LINEAGE_FILES = ("metrics.jsonl", "trained_rollouts.jsonl", "samples.jsonl")


class ResumeError(RuntimeError):
    """The directory cannot be resumed as asked; the message says why (exit 2)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    weight_version: int


@dataclass
class ResumePlan:
    """What `parity run --resume` continues from."""

    run_dir: Path
    config: ParityConfig  # the effective config of the resumed launch
    stream: str
    redis_password: str | None  # None: the run used an external Redis
    checkpoint: Checkpoint | None
    overrides: dict[str, tuple[object, object]] = field(default_factory=dict)
    record: dict = field(default_factory=dict)  # the previous config.json

    @property
    def step(self) -> int:
        return self.checkpoint.step if self.checkpoint else 0


def flat(config: ParityConfig) -> dict[str, object]:
    """`section.field` -> value, for every key of the config."""
    return {
        f"{section}.{name}": value for section, model in config for name, value in model.model_dump().items()
    }


def config_diff(stored: ParityConfig, requested: ParityConfig) -> dict[str, tuple[object, object]]:
    """Keys whose values differ (stored, requested), NOT_COMPARED and secrets left out."""
    old, new = flat(stored), flat(requested)
    return {
        key: (old[key], new[key])
        for key in old
        if key not in NOT_COMPARED and not key.endswith("auth_token") and old[key] != new[key]
    }


def format_diff(diff: dict[str, tuple[object, object]]) -> str:
    return ", ".join(
        f"{key} ({old!r} in config.toml, {new!r} now)" for key, (old, new) in sorted(diff.items())
    )


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    from trainer.checkpoint import CheckpointStore, TrainerState

    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    path = CheckpointStore(run_dir).latest()
    if path is None:
        return None
    state = TrainerState.from_json((path / "state.json").read_text())
    return Checkpoint(path, state.step, state.weight_version)


def redis_password(run_dir: Path) -> str | None:
    """The private Redis's password (its redis.conf); None when the run had no private Redis."""
    conf = run_dir / "logs" / "redis" / "redis.conf"
    if not conf.exists():
        return None
    for line in conf.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "requirepass":
            return value.strip()
    return ""


def truncate_lineage(run_dir: Path, step: int) -> None:
    """Cut the per-step files back to `step` (atomically, each)."""
    from trainer.telemetry import truncate_to_step

    for name in LINEAGE_FILES:
        truncate_to_step(run_dir / name, step)


def no_config(run_dir: Path) -> str:
    """Why `run_dir` cannot be resumed when it has no config.toml, and what to do instead."""
    from commands.run import records

    running = records.live_launcher(run_dir)
    if running is not None:
        return f"run.resume: {run_dir} is still running (launcher pid {running})"
    launches = (records.read(run_dir) or {}).get("launches", [])
    if not launches:
        return f"run.resume: {run_dir} holds no run to resume (no config.toml)"
    first = " ".join(launches[0].get("argv", []))
    return (
        f"run.resume: {run_dir} holds no run to resume (no config.toml): its first launch stopped "
        f"before it wrote one, so nothing ran; start it again with that launch's command: parity run {first}"
    )


def plan(run_dir: Path, argv: list[str], environ: dict[str, str] | None = None) -> ResumePlan:
    """Check that `run_dir` can be resumed with the command line `argv`; raise ResumeError if not."""
    from commands.run import records

    environ = dict(os.environ if environ is None else environ)
    config_path = run_dir / "config.toml"
    record_path = run_dir / "config.json"
    if not config_path.exists():
        raise ResumeError(no_config(run_dir))
    running = records.live_launcher(run_dir)
    if running is not None:
        raise ResumeError(f"run.resume: {run_dir} is still running (launcher pid {running})")
    stored = load([], environ={CONFIG_FILE_ENV: str(config_path)}).config
    requested = load(argv, home="run", environ={**environ, CONFIG_FILE_ENV: str(config_path)}).config
    diff = config_diff(stored, requested)
    if diff and not requested.run.resume_override:
        raise ResumeError(
            f"run.resume: the config differs from {config_path}: {format_diff(diff)}; "
            "pass --resume_override to resume with the new values"
        )
    checkpoint = latest_checkpoint(run_dir)
    steps_done = checkpoint.step if checkpoint else 0
    if steps_done >= requested.run.steps:
        raise ResumeError(
            f"run.resume: {run_dir} has finished its {steps_done} steps; resume with a larger "
            "--steps and --resume_override to train further"
        )
    # config.json is written once the services are up; a launch killed before that has none
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    password = redis_password(run_dir)
    url = requested.run.redis_url
    if password is not None:
        url = ""  # the run's own server, restarted below (config.toml holds its URL masked)
    elif not url or "***@" in url:
        raise ResumeError(
            "run.redis_url: this run used an external Redis; pass its URL again to resume "
            "(PARITY_RUN_REDIS_URL; --redis_url only for a URL without a password)"
        )
    return ResumePlan(
        run_dir=run_dir,
        config=requested.model_copy(update={"run": requested.run.model_copy(update={"redis_url": url})}),
        stream=stored.run.stream,
        redis_password=password,
        checkpoint=checkpoint,
        overrides=diff,
        record=record,
    )
