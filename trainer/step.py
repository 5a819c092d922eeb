"""The model-facing stages of a training step: forward_backward, then optimizer_step.

    parts = [loss, stats = policy_loss(forward(chunk)); loss.backward()  for trainable micro-batches]
          + [stats of forward(chunk)                                     for frozen micro-batches]
    stats = StepStats.join(parts)                # one host copy per field
    clip_grad_norm_; optimizer.step(); scheduler.step()   # only if finite and something trained

Invariants:
- `forward_backward` is the only place the policy runs with grad. It returns what it measured by
  value; it changes no state but the gradients.
- Micro-batches follow `trainer.micro_batch_size` / `micro_batch_tokens` (packed or padded); on
  several ranks every rank runs equally many of each kind (empty ones idle), so FSDP2's
  collectives pair up.
- A non-finite gradient norm takes no optimizer step (the step's rollouts are then dropped by the
  caller, not trained).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer import fsdp
from trainer.device import to_device
from trainer.loss import LossInputs, policy_loss
from trainer.own_version import rescore_at_versions
from trainer.policy import token_budget_batches, token_logprobs
from trainer.prepare import ScoredSequence, model_positions
from trainer.stats import StepStats
from trainer.weight_history import WeightHistory

if TYPE_CHECKING:
    import torch

    from parity.config.trainer import TrainerConfig


@dataclass(frozen=True)
class StepModels:
    """What the step runs: the policy (with its fp32 head), the optional reference model (KL) and
    the frozen copy past versions are loaded into (recompute / own-version), on one device."""

    scorer: Any
    ref_model: Any | None
    old_model: Any | None
    device: Any
    distributed: bool


@dataclass(frozen=True)
class OptimizerResult:
    grad_norm: float  # before clipping; NaN or inf when the gradient was not finite
    lr: float  # after the scheduler step
    stepped: bool


def split_micro_batches(
    sequences: list[ScoredSequence], config: TrainerConfig, device, distributed: bool
) -> list[list[ScoredSequence]]:
    chunks = token_budget_batches(
        sequences,
        lambda s: s.inputs,
        config.micro_batch_size,
        config.micro_batch_tokens,
        packed=config.packing,
        share_prompts=config.packing and config.share_prompts,
    )
    # Ranks of a sharded model run equally many micro-batches (empty ones idle).
    return fsdp.align_micro_batches(chunks, device) if distributed else chunks


def forward_backward(
    models: StepModels,
    config: TrainerConfig,
    history: WeightHistory,
    sequences: list[ScoredSequence],
    weight_version: int,
    counts: tuple[int, int],
) -> StepStats:
    """Gradients of `sequences` accumulated into the policy; what every micro-batch measured.
    `counts` = (trainable tokens, trainable sequences) of the whole batch over all ranks."""
    import torch

    trainable = [s for s in sequences if s.trainable]
    frozen = [s for s in sequences if not s.trainable]
    parts: list[StepStats] = []
    for chunk in split_micro_batches(trainable, config, models.device, models.distributed):
        if not chunk:  # another rank has more micro-batches: join its collectives, add nothing
            fsdp.idle_micro_batch(models.scorer, models.ref_model, train=True)
            continue
        loss, part = _train_micro_batch(models, config, history, chunk, weight_version, counts)
        if loss.requires_grad:
            loss.backward()
        parts.append(part)
    with torch.no_grad():
        for chunk in split_micro_batches(frozen, config, models.device, models.distributed):
            if not chunk:
                fsdp.idle_micro_batch(models.scorer, models.ref_model, train=False)
                continue
            new_T, entropy_T = token_logprobs(
                models.scorer, [s.inputs for s in chunk], keep=model_positions(chunk)
            )
            part = _forward_stats(chunk, new_T, entropy_T, _behaviour(chunk, models.device), weight_version)
            part.eval_forward_tokens = sum(s.forward_tokens for s in chunk)
            part.loss = None
            parts.append(part)
    if models.distributed:  # else the clip would miss the root group's gradients (fsdp.reshard_all)
        fsdp.reshard_all(models.scorer)
    return StepStats.join(parts)


def optimizer_step(model, optimizer, scheduler, grad_clip: float, trainable_tokens: int) -> OptimizerResult:
    """Clip, then AdamW and scheduler steps when something trained and the norm is finite."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))  # a collective: every rank
    if trainable_tokens == 0:  # nothing trained (every group flat): no gradient to measure, not 0.0
        grad_norm = math.nan
    stepped = trainable_tokens > 0 and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return OptimizerResult(grad_norm, float(scheduler.get_last_lr()[0]), stepped)


def _behaviour(chunk: list[ScoredSequence], device) -> torch.Tensor:
    import torch

    rollout_T = torch.tensor([lp for s in chunk for lp in s.rollout_logprobs], dtype=torch.float32)
    return to_device(rollout_T, device)


def _forward_stats(chunk, new_T, entropy_T, behaviour_T, weight_version: int) -> StepStats:
    """The per-token fields every micro-batch records (the loss-only ones empty)."""
    import torch

    empty = torch.zeros(0)
    return StepStats(
        trainer_logprobs=new_T.detach().float(),
        rollout_logprobs=behaviour_T,
        entropy=entropy_T.detach(),
        lags=torch.tensor([lag for s in chunk for lag in s.lags(weight_version)], dtype=torch.long),
        clean=torch.tensor([c for s in chunk for c in s.clean()], dtype=torch.bool),
        clip=empty,
        kl_new_old=empty,
        is_weights=empty,
        is_corrected=empty,
        kl_ref=empty,
    )


def _train_micro_batch(
    models: StepModels,
    config: TrainerConfig,
    history: WeightHistory,
    chunk: list[ScoredSequence],
    weight_version: int,
    counts: tuple[int, int],
) -> tuple[torch.Tensor, StepStats]:
    import torch

    device = models.device
    keep = model_positions(chunk)  # an episode's environment tokens are context, never scored
    new_T, entropy_T = token_logprobs(models.scorer, [s.inputs for s in chunk], keep=keep)
    behaviour_T = _behaviour(chunk, device)
    part = _forward_stats(chunk, new_T, entropy_T, behaviour_T, weight_version)
    lengths_S = torch.tensor([s.num_tokens for s in chunk])
    seq_lengths_S = to_device(lengths_S, device)
    # Built on the host: repeat_interleave on the device would wait for the GPU (its output size).
    seq_index_T = to_device(torch.repeat_interleave(torch.arange(len(chunk)), lengths_S), device)
    recomputed_T = None
    if config.old_logprobs == "recompute":
        recomputed_T, known_T = rescore_at_versions(models.old_model, history, chunk, behaviour_T, device)
        # Backend mismatch on every token, stale or not: trainer vs rollout at the same weights. Not
        # on mixed-context tokens (sampled over KV an older version computed, a keep-mode update mid
        # turn): the replay runs the whole sequence at the token's own version, so they would read
        # as backend error.
        measured_T = known_T & to_device(part.clean, device)
        part.at_version_trainer_logprobs = recomputed_T[measured_T].float()
        part.at_version_rollout_logprobs = behaviour_T[measured_T].float()
    ref_T = None
    if models.ref_model is not None:
        with torch.no_grad():
            ref_T, _ = token_logprobs(
                models.ref_model, [s.inputs for s in chunk], with_entropy=False, keep=keep
            )
    advantages_S = to_device(torch.tensor([s.advantage for s in chunk], dtype=torch.float32), device)
    loss, loss_stats = policy_loss(
        config,
        LossInputs(
            new_T=new_T,
            behaviour_T=behaviour_T,
            advantages_S=advantages_S,
            seq_index_T=seq_index_T,
            seq_lengths_S=seq_lengths_S,
            total_tokens=counts[0],
            total_seqs=counts[1],
            recomputed_T=recomputed_T,
            ref_T=ref_T,
        ),
    )
    part.clip = loss_stats.clip
    part.kl_new_old = loss_stats.kl_new_old
    part.is_weights = loss_stats.is_weights
    part.is_corrected = loss_stats.is_corrected
    if loss_stats.kl_ref is not None:
        part.kl_ref = loss_stats.kl_ref
    part.nonfinite_tokens = loss_stats.nonfinite_tokens
    part.train_forward_tokens = sum(s.forward_tokens for s in chunk)
    part.loss = loss.detach()
    return loss, part
