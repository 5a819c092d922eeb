"""The `model` section: which weights every component loads as version 0."""

from __future__ import annotations

from pydantic import Field

from parity.config.base import Section


class ModelConfig(Section):
    """The model the rollout engines and the trainer both load (`parity models` prepares it)."""

    name: str = Field(
        "smollm2-135m",
        min_length=1,
        description="Model: tiny or smollm2-135m (built in), a Hugging Face model directory, or a Hub "
        "id ORG/NAME (resolved through the Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1). "
        "`--model X` is short for `--model.name X`.",
    )
