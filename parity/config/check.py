"""The `check` section: `parity check`, the rollout-vs-trainer mismatch measurement and gate.

The engine under test is described by the `rollout` and `model` sections (the same switches a
rollout service runs with); the prompts come from `task.name`, seeded by `run.seed`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from parity.config.base import Section, check_address

DEFAULT_THRESHOLD = 1e-3


class CheckConfig(Section):
    """What `parity check` samples and the gate it applies (the launcher's preflight uses the task's
    sampling instead, so that it measures the settings training will use)."""

    rollout_address: str = Field(
        "", description="HOST:PORT of a running rollout service to check; empty starts one."
    )
    num_prompts: int = Field(8, ge=1, le=4096, description="Prompts in the fixed, seeded prompt set.")
    samples_per_prompt: int = Field(2, ge=1, le=64, description="Completions sampled per prompt.")
    max_tokens: int = Field(24, ge=1, le=4096, description="Maximum tokens per completion.")
    temperature: float = Field(
        0.7, gt=0, le=10, description="Sampling temperature. Not 1, so raw and processed logprobs differ."
    )
    top_p: float = Field(0.9, gt=0, le=1, description="Nucleus mass (1 disables).")
    top_k: int = Field(0, ge=0, description="Top-k (0 disables).")
    threshold: float = Field(
        DEFAULT_THRESHOLD,
        gt=0,
        description="Largest passing mean k3 (KL) per token; see commands/check/check.py for why 1e-3.",
    )
    on_mismatch: Literal["warn", "stop"] = Field(
        "stop",
        description="During training: when the own-version backend mismatch over informative tokens "
        "(mismatch_k3_own_version_informative) exceeds the running gate's threshold for `gate_steps` "
        "consecutive measured steps, stop the run (or only warn).",
    )
    gate_threshold: float = Field(
        0.0,
        ge=0,
        description="The running gate's largest passing k3 per step. 0 (the default): 1e-6 when the rollouts "
        "and the trainer both compute in float32; with bf16 on either side, 1e-1, or 10x the k3 the "
        "preflight measured on this engine and model where that is larger. docs/ab_study.md has the "
        "measurements behind both.",
    )
    gate_steps: int = Field(
        1, ge=1, description="Consecutive measured steps over the threshold before the running gate acts."
    )
    out: str = Field(
        "", description="Write check.json, check.txt and check_hist.png here; empty = checks/<UTC time>."
    )
    ablate: bool = Field(False, description="Also run one row per correctness fix turned off.")
    faults: bool = Field(
        False,
        description="Instead of checking an engine: inject every fault class of the catalogue into an "
        "in-process run (on `check.fault_model`) and report when the running gate caught it and what "
        "its localisation named (docs/ab_study.md).",
    )
    fault_classes: str = Field(
        "",
        description="--faults: a comma-separated subset of the catalogue's classes (empty: all of them).",
    )
    fault_model: str = Field(
        "tiny",
        min_length=1,
        description="--faults: the model of the in-process runs (a name or directory as for model.name); "
        "tiny takes seconds a class, smollm2-135m about a minute.",
    )
    update_scale: float = Field(
        0.05, gt=0, description="--ablate: relative size of the weight update in the prefix-cache rows."
    )

    @field_validator("rollout_address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)
