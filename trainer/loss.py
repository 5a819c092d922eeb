"""The policy loss of one micro-batch, pure: logprobs in, `(loss, LossStats)` out by value.

Legend: T completion tokens of the micro-batch (flat, sequence order), S its sequences.

Which logprobs are the "old" policy of the ratio (`old_logprobs` and `is_correction`):
- recompute: the trainer's own logprobs at each token's version (`recomputed_T`, from the weight
  history; behaviour logprobs where that version is no longer held);
- decoupled PPO (an IS correction on, no recompute): the current policy, detached;
- otherwise the behaviour (rollout) logprobs.
A token is left out when any logprob its loss needs is not finite: the trainer's (its top-k/top-p
mask excludes the token), the old one (a recomputed logprob at a version whose mask excluded it) or
the behaviour one. Such a token gets zero loss, no KL to the reference, and NaN (not measured) in
the per-token statistics; it is counted in `nonfinite_tokens`. Its logprobs are replaced by zeros
before any arithmetic, so nothing non-finite reaches the gradient. Likewise a token whose
reference logprob is not finite (outside the reference's top-k/top-p set) gets no KL penalty.
The loss is already divided by the whole batch's token (or sequence) count, so summing
micro-batch gradients gives the batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer import objectives, offpolicy

if TYPE_CHECKING:
    import torch

    from parity.config.trainer import TrainerConfig


@dataclass(frozen=True)
class LossInputs:
    new_T: torch.Tensor  # the trainer's logprobs, with grad
    behaviour_T: torch.Tensor  # the engine's logprobs of the same tokens
    advantages_S: torch.Tensor
    seq_index_T: torch.Tensor  # token -> sequence in [0, S)
    seq_lengths_S: torch.Tensor
    total_tokens: int  # trainable tokens of the whole batch (all ranks): the loss normaliser
    total_seqs: int
    recomputed_T: torch.Tensor | None = None  # old_logprobs=recompute: logprobs at each token's version
    ref_T: torch.Tensor | None = None  # the reference model's logprobs (KL penalty), no grad


@dataclass(frozen=True)
class LossStats:
    """Per-token (GSPO's clip: per-sequence) statistics of the loss, detached."""

    clip: torch.Tensor
    kl_new_old: torch.Tensor
    is_weights: torch.Tensor
    is_corrected: torch.Tensor
    kl_ref: torch.Tensor | None  # None without a reference model
    nonfinite_tokens: torch.Tensor  # 0-d count (kept on the device: no sync per micro-batch)


def policy_loss(config: TrainerConfig, inputs: LossInputs) -> tuple[torch.Tensor, LossStats]:
    """GRPO / PPO-clip (per token) or GSPO (per sequence), IS-weighted, plus the KL penalty."""
    import torch

    cfg, x = config, inputs
    num_seqs = int(x.seq_lengths_S.numel())
    finite_T = torch.isfinite(x.new_T.detach()) & torch.isfinite(x.behaviour_T)
    if x.recomputed_T is not None:
        finite_T &= torch.isfinite(x.recomputed_T)
    zero_T = torch.zeros_like(x.behaviour_T)
    # a left-out token is 0 on every side: ratio 1, IS weight 1, no term in GSPO's sequence mean
    new_safe_T = torch.where(finite_T, x.new_T, zero_T)
    behaviour_T = torch.where(finite_T, x.behaviour_T, zero_T)
    if x.recomputed_T is not None:
        old_T = torch.where(finite_T, x.recomputed_T, zero_T)
    elif cfg.is_correction != "none":
        old_T = new_safe_T.detach()  # decoupled PPO: the proximal policy is the current one
    else:
        old_T = behaviour_T
    weights_T, corrected_T = offpolicy.is_weights(
        old_T, behaviour_T, x.seq_index_T, num_seqs, cfg.is_correction, cfg.is_level, cfg.is_cap
    )
    nan_T = torch.full_like(zero_T, float("nan"))
    kl_new_old_T = torch.where(finite_T, objectives.kl_k3(new_safe_T.detach(), old_T), nan_T)
    eps_low, eps_high = cfg.clip_range()
    if cfg.objective == "gspo":
        loss_S, clip = objectives.gspo_sequence_loss(
            new_safe_T, old_T, x.advantages_S, x.seq_index_T, num_seqs, eps_low, eps_high
        )
        w_S = objectives.segment_mean(weights_T, x.seq_index_T, num_seqs)
        loss = objectives.aggregate_sequences(
            loss_S * w_S, x.seq_lengths_S, cfg.loss_agg, x.total_tokens, x.total_seqs
        )
    else:
        loss_T, clip = objectives.ppo_clip_token_loss(
            new_safe_T, old_T, x.advantages_S[x.seq_index_T], eps_low, eps_high
        )
        loss_T = torch.where(finite_T, loss_T * weights_T, torch.zeros_like(loss_T))
        loss = objectives.aggregate(
            loss_T, x.seq_index_T, x.seq_lengths_S, cfg.loss_agg, x.total_tokens, x.total_seqs
        )
    kl_ref_T = None
    if x.ref_T is not None:
        with_ref_T = finite_T & torch.isfinite(x.ref_T)
        ref_safe_T = torch.where(with_ref_T, x.ref_T, zero_T)
        kl_T = torch.where(with_ref_T, objectives.kl_k3(new_safe_T, ref_safe_T), zero_T)
        kl_ref_T = torch.where(with_ref_T, kl_T.detach(), nan_T)
        loss = loss + cfg.kl_coef * objectives.aggregate(
            kl_T, x.seq_index_T, x.seq_lengths_S, cfg.loss_agg, x.total_tokens, x.total_seqs
        )
    stats = LossStats(
        clip=clip,
        kl_new_old=kl_new_old_T,
        is_weights=weights_T,
        is_corrected=corrected_T,
        kl_ref=kl_ref_T,
        nonfinite_tokens=(~finite_T).sum(),
    )
    return loss, stats
