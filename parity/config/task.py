"""The `task` section: what the run trains on and how training rollouts are sampled.

The rollout actor samples with these settings; the trainer replays each rollout's own sampling
params from the stream, so it never reads this section to score a token.
"""

from __future__ import annotations

from pydantic import Field

from parity.config.base import Section


class TaskConfig(Section):
    """The RL problem: prompts with a verifiable reward, GRPO groups, sampling of training rollouts."""

    name: str = Field(
        "arithmetic_final",
        description="Task with a verifiable reward (rollout/tasks); arithmetic_final scores the last integer.",
    )
    group_size: int = Field(8, ge=1, le=64, description="Completions per prompt (one GRPO group, n).")
    max_tokens: int = Field(12, ge=1, le=4096, description="Maximum generated tokens per completion.")
    temperature: float = Field(0.5, gt=0.0, le=10.0, description="Sampling temperature of training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass of training rollouts (1 disables).")
    top_k: int = Field(0, ge=0, description="Top-k of training rollouts (0 disables).")
    eval_size: int = Field(
        100, ge=0, le=10_000, description="Held-out prompts scored greedily before and after; 0 skips."
    )
    eval_max_tokens: int = Field(0, ge=0, le=4096, description="Tokens per eval answer; 0 = max_tokens.")

    @property
    def eval_tokens(self) -> int:
        return self.eval_max_tokens or self.max_tokens
