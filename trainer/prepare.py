"""Stage 1 of a training step, pure: rollout groups -> the sequences the step trains on.

Invariants:
- Advantages are per group (GRPO: mean-centred, divided by the std except for PPO); a group whose
  rewards are all equal has zero advantage and is *frozen* (scored forward-only for the metrics)
  unless a KL penalty still gives its tokens a gradient.
- A sample with no completion tokens contributes its reward to the step's reward statistics and
  nothing else.
- Nothing here touches the model, the queue or the clock: the same batch gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parity.sampling import SamplingTransform
from trainer import objectives
from trainer.consumer import Batch, token_context_versions, token_versions
from trainer.offpolicy import token_lags
from trainer.policy import SequenceInput

if TYPE_CHECKING:
    from parity.config.trainer import TrainerConfig


@dataclass
class ScoredSequence:
    """One rollout sample, ready for the step: its tokens, the logprobs and weight versions the
    engine reported per token, and its advantage."""

    inputs: SequenceInput
    rollout_logprobs: list[float]
    versions: list[int]
    advantage: float
    trainable: bool
    contexts: list[int] = field(default_factory=list)  # per token, the oldest KV version it attended to
    group_index: int = 0
    # Episodes: per completion token, whether the model sampled it (empty: every token is the
    # model's). The per-token lists above cover the model's tokens only.
    loss_mask: tuple[bool, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Model tokens (the ones with a logprob, a version and a loss)."""
        return len(self.rollout_logprobs)

    @property
    def forward_tokens(self) -> int:
        """Tokens through the model: prompt and completion (environment turns included)."""
        return len(self.inputs.prompt_ids) + len(self.inputs.completion_ids)

    def lags(self, trainer_version: int) -> list[int]:
        """Per token, how many versions behind the trainer's weights it was sampled."""
        return token_lags(trainer_version, self.versions)

    def clean(self) -> list[bool]:
        """Per token: every KV it attended to came from its own version (no mixed context)."""
        return [c == v for v, c in zip(self.versions, self.contexts, strict=True)]


@dataclass
class PreparedBatch:
    """What `prepare` makes of a batch."""

    sequences: list[ScoredSequence]
    rewards: list[float]  # every sample's reward, empty completions included
    zero_variance_groups: int

    @property
    def trainable(self) -> list[ScoredSequence]:
        return [s for s in self.sequences if s.trainable]

    @property
    def frozen(self) -> list[ScoredSequence]:
        return [s for s in self.sequences if not s.trainable]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


def model_positions(chunk: list[ScoredSequence]) -> list[bool] | None:
    """Over the chunk's completion tokens in order, which the model sampled; None when all did
    (no episode in the chunk), so a single-turn step selects nothing."""
    if not any(s.loss_mask for s in chunk):
        return None
    return [bool(m) for s in chunk for m in (s.loss_mask or (True,) * len(s.inputs.completion_ids))]


def trainable_counts(sequences: list[ScoredSequence]) -> tuple[int, int]:
    """(trainable tokens, trainable sequences): the loss normaliser of a step."""
    trainable = [s for s in sequences if s.trainable]
    return sum(s.num_tokens for s in trainable), len(trainable)


def prepare(batch: Batch, config: TrainerConfig) -> PreparedBatch:
    """Advantages per group and one ScoredSequence per sample with completion tokens."""
    import torch

    sequences: list[ScoredSequence] = []
    rewards: list[float] = []
    zero_groups = 0
    for group_index, group in enumerate(batch.groups):
        group_rewards = torch.tensor([[s.reward for s in group.samples]], dtype=torch.float64)
        adv = objectives.group_advantages(group_rewards, normalise_std=config.objective != "ppo")
        zero = bool(adv.zero_variance_G[0])
        zero_groups += int(zero)
        transform = SamplingTransform.from_proto(group.sampling)
        prompt = tuple(int(t) for t in group.prompt_token_ids)
        for sample, advantage in zip(group.samples, adv.values_GN[0].tolist(), strict=True):
            rewards.append(float(sample.reward))
            if not sample.token_ids:
                continue
            sequences.append(
                ScoredSequence(
                    inputs=SequenceInput(prompt, tuple(int(t) for t in sample.token_ids), transform),
                    rollout_logprobs=list(sample.logprobs),
                    versions=token_versions(group, sample),
                    advantage=float(advantage),
                    trainable=not zero or config.kl_coef > 0,
                    contexts=token_context_versions(group, sample),
                    group_index=group_index,
                    loss_mask=tuple(bool(m) for m in sample.loss_mask),
                )
            )
    return PreparedBatch(sequences, rewards, zero_groups)
