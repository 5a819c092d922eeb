"""`parity run` configuration: one typed, validated record of every setting the launcher passes on.

Invariants:
- Every field has a description (it is the `--help` text) and is validated before any process starts.
- Flags are accepted as `--flag value`, `--flag=value`, and with dashes or underscores
  (`--rollout-workers` == `--rollout_workers`). Booleans take `true|false` or stand alone (`--flag`).
- A bad value is a `RunConfigError` whose message names the flag (`--steps: ...`); `main` turns it
  into exit code 2, the same code argparse uses for unknown flags.
- The defaults are the laptop demo: SmolLM2-135M on arithmetic, vLLM with the correctness defaults,
  sized to finish in about 15 minutes on 2 CPU cores (see docs/run.md for the measurement).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

RunMode = Literal["async", "sync"]


class RunConfigError(ValueError):
    """A `parity run` flag is invalid; the message starts with the flag's name."""


class RunConfig(BaseModel):
    """Everything `parity run` needs. Field names are the flag names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # What to train.
    model: str = Field("smollm2-135m", description="Model: tiny, smollm2-135m, or an HF model directory.")
    task: str = Field(
        "arithmetic_final",
        description="Task with a verifiable reward (rollout/tasks); arithmetic_final scores the last integer.",
    )
    steps: int = Field(16, ge=1, le=100_000, description="Optimizer steps the trainer takes before stopping.")
    mode: RunMode = Field(
        "async",
        description="async: generation overlaps training (PipelineRL). sync: generate -> train -> update.",
    )
    seed: int = Field(0, ge=0, description="Seed for prompts, sampling and the trainer.")
    out: str = Field("", description="Run directory; default runs/<UTC timestamp>.")

    # Scale.
    rollout_workers: int = Field(1, ge=1, le=16, description="Rollout services (one vLLM engine each).")
    groups_per_step: int = Field(4, ge=1, le=1024, description="GRPO groups consumed per optimizer step.")
    group_size: int = Field(8, ge=2, le=64, description="Completions per prompt (one GRPO group).")
    max_tokens: int = Field(12, ge=1, le=4096, description="Maximum generated tokens per completion.")
    temperature: float = Field(
        0.5, gt=0.0, le=10.0, description="Sampling temperature for training rollouts."
    )
    lr: float = Field(3e-5, gt=0.0, le=1.0, description="Trainer learning rate.")
    publish_every: int = Field(1, ge=1, le=10_000, description="Publish new weights every N steps.")
    max_lag: int = Field(
        2, ge=0, le=1000, description="Staleness bound in versions; the actor pauses beyond it."
    )
    actor_concurrency: int = Field(
        8, ge=1, le=256, description="Groups each rollout service's actor generates concurrently."
    )
    objective: Literal["grpo", "ppo", "gspo"] = Field("grpo", description="Policy-gradient objective.")
    trainer_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="torch intra-op threads of the trainer; 0 leaves torch's default (one per core).",
    )
    skip_zero_variance: bool = Field(
        True,
        description="Dynamic sampling: the actors do not publish groups whose rewards are all equal "
        "(no GRPO signal) and generate another prompt instead.",
    )
    redis_url: str = Field("", description="Use this Redis instead of starting a private redis-server.")

    # Train-inference parity switches (the correctness defaults).
    engine: Literal["vllm", "reference"] = Field(
        "vllm", description="Rollout engine: vLLM V1, or the HF reference engine with trainer numerics."
    )
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed", description="Rollout logprobs after the sampling transform (processed) or raw logits."
    )
    head_dtype: Literal["float32", "model"] = Field(
        "float32", description="dtype of the rollout engine's lm_head / logits."
    )
    prefix_caching: bool = Field(False, description="vLLM prefix caching (reset at every update when on).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Rollout model dtype.")

    # Evaluation and the preflight gate.
    eval_size: int = Field(
        100, ge=0, le=10_000, description="Held-out prompts scored greedily before and after; 0 skips."
    )
    eval_max_tokens: int = Field(0, ge=0, le=4096, description="Tokens per eval answer; 0 = max_tokens.")
    skip_preflight: bool = Field(False, description="Do not run the rollout-vs-trainer mismatch check.")
    i_know_the_mismatch_is_high: bool = Field(
        False, description="Run even when the preflight check fails (it is still run and recorded)."
    )

    # Plumbing.
    max_model_len: int = Field(512, ge=64, le=131_072, description="vLLM context length.")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Seconds each service may take to report SERVING."
    )
    step_timeout_s: float = Field(
        900.0, gt=0, description="Abort when no optimizer step lands for this many seconds."
    )
    progress_interval_s: float = Field(
        10.0, gt=0, description="Seconds between progress lines when no step lands."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.publish_every > self.steps:
            raise ValueError("publish_every: must be <= steps, or no new weights are ever published")
        if self.mode == "sync" and self.groups_per_step % self.rollout_workers:
            raise ValueError(
                f"groups_per_step: in sync mode it must be divisible by rollout_workers "
                f"({self.rollout_workers}) so that every worker generates the same share"
            )
        if self.mode == "sync" and self.publish_every != 1:
            raise ValueError("publish_every: sync mode publishes every step (generate -> train -> update)")
        return self

    @property
    def eval_tokens(self) -> int:
        return self.eval_max_tokens or self.max_tokens

    def run_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        return Path("runs") / dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")

    def worker_groups_per_step(self) -> int:
        """Groups each actor generates per version in sync mode (async actors share one backlog)."""
        if self.mode == "sync":
            return self.groups_per_step // self.rollout_workers
        return self.groups_per_step

    def as_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True)


def _flag(name: str) -> str:
    return f"--{name}"


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"true", "1", "yes", "on"}:
        return True
    if lowered in {"false", "0", "no", "off"}:
        return False
    raise ValueError(f"expected true or false (got {raw!r})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity run",
        description="Run the whole pipeline on this machine: redis, broadcast, trainer, rollout services.",
        allow_abbrev=False,
    )
    for name, field in RunConfig.model_fields.items():
        options = [_flag(name)]
        if "_" in name:
            options.append(_flag(name.replace("_", "-")))
        kwargs: dict = {
            "dest": name,
            "default": None,
            "help": f"{field.description} (default: {field.default!r})",
        }
        if field.annotation is bool:
            kwargs.update(nargs="?", const="true", metavar="true|false")
        else:
            kwargs.update(metavar=name.upper())
        parser.add_argument(*options, **kwargs)
    return parser


def _error_for(exc: ValidationError) -> RunConfigError:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        message = err["msg"].removeprefix("Value error, ")
        if not loc and ":" in message:  # model-level check: "field: why"
            name, _, why = message.partition(":")
            lines.append(f"{_flag(name.strip())}:{why}")
            continue
        got = err.get("input")
        lines.append(f"{_flag(loc[0]) if loc else '<config>'}: {message} (got {got!r})")
    return RunConfigError("; ".join(lines))


def parse_run_config(argv: Sequence[str]) -> RunConfig:
    """Parse `parity run` flags into a RunConfig; raise RunConfigError naming the flag.

    argparse itself exits 2 on unknown flags and missing values (with its usage line).
    """
    namespace = build_parser().parse_args(list(argv))
    given: dict[str, object] = {}
    for name, field in RunConfig.model_fields.items():
        raw = getattr(namespace, name)
        if raw is None:
            continue
        if field.annotation is bool:
            try:
                given[name] = _parse_bool(raw)
            except ValueError as exc:
                raise RunConfigError(f"{_flag(name)}: {exc}") from None
        else:
            given[name] = raw
    try:
        return RunConfig(**given)
    except ValidationError as exc:
        raise _error_for(exc) from None
