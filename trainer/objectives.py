"""Policy-gradient objectives as small pure functions: GRPO advantages, PPO-clip, GSPO, KL.

Legend: G groups, N samples per group, T tokens (a flat batch of completion tokens), S sequences.
`seq_index_T` maps each token to its sequence in [0, S). Logprobs are float32.

Conventions (each is tested against hand-computed values in tests/test_objectives.py):
- GRPO advantage: (r - mean_group) / (std_group + eps), population std. A group whose rewards are
  all equal has zero advantage everywhere and is reported as `zero_variance`; it adds no gradient.
- "ppo" here is PPO-clip without a critic: advantage = r - mean_group (no std normalisation).
- PPO-clip per token: -min(ρ·A, clip(ρ, 1-ε_lo, 1+ε_hi)·A), ρ = exp(logp_new - logp_old).
- GSPO: one ratio per sequence, s = exp(mean_t(logp_new - logp_old)), clipped the same way.
- clip_rate = fraction of tokens (sequences for GSPO) whose ratio lies outside [1-ε_lo, 1+ε_hi],
  i.e. where clamping the log-ratio changed it (the clamp_log_ratio_new_old indicator).
- Aggregation: "token" averages over every token of the batch; "sequence" averages each sequence's
  token mean over sequences. The caller passes the batch-level normaliser so that gradient
  accumulation over micro-batches gives exactly the full-batch loss.
- KL to the reference policy: k3 = exp(ref - new) - (ref - new) - 1 per token (>= 0). It is
  unbiased for KL(new || ref) on samples from `new`; the batch's tokens come from the behaviour
  policy (up to max_lag versions old), and as a loss its gradient in expectation is that of
  KL(ref || new), as in DeepSeekMath's GRPO.
- Log-ratios are clamped to ±MAX_LOG_RATIO before `exp` (e^20 ≈ 4.9e8), so one extreme token
  cannot overflow float32 into an inf or NaN loss; beyond the clamp its gradient is zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

ADV_EPS = 1e-6
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to ±this before exp (module docstring)


def clamp_log_ratio(delta: torch.Tensor) -> torch.Tensor:
    """A log-ratio bounded to ±MAX_LOG_RATIO, so that its `exp` stays finite in float32."""
    return delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


@dataclass(frozen=True)
class Advantages:
    values_GN: torch.Tensor
    zero_variance_G: torch.Tensor  # bool


def group_advantages(
    rewards_GN: torch.Tensor, normalise_std: bool = True, eps: float = ADV_EPS
) -> Advantages:
    """Group-relative advantages; groups with zero reward variance get exactly 0."""
    import torch

    rewards_GN = rewards_GN.double()
    mean_G1 = rewards_GN.mean(dim=1, keepdim=True)
    centred_GN = rewards_GN - mean_G1
    std_G1 = rewards_GN.std(dim=1, keepdim=True, unbiased=False)
    zero_G = (std_G1.squeeze(1) <= 1e-12) | (rewards_GN.shape[1] < 2)
    values_GN = centred_GN / (std_G1 + eps) if normalise_std else centred_GN
    values_GN = torch.where(zero_G.unsqueeze(1), torch.zeros_like(values_GN), values_GN)
    return Advantages(values_GN.float(), zero_G)


def clip_indicator(ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """1.0 where the ratio is outside [1 - eps_low, 1 + eps_high]."""
    return ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).float()


def ppo_clip_token_loss(
    new_logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss [T], clipped indicator [T]). The ratio's gradient flows through new_logprobs."""
    import torch

    ratio_T = torch.exp(clamp_log_ratio(new_logprobs_T - old_logprobs_T))
    clipped_T = ratio_T.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_T = -torch.minimum(ratio_T * advantages_T, clipped_T * advantages_T)
    return loss_T, clip_indicator(ratio_T.detach(), eps_low, eps_high)


def segment_mean(values_T: torch.Tensor, seq_index_T: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Mean of `values_T` per sequence -> [S] (sequences with no tokens give 0)."""
    import torch

    sums_S = torch.zeros(num_seqs, dtype=values_T.dtype, device=values_T.device).index_add(
        0, seq_index_T, values_T
    )
    counts_S = torch.zeros(num_seqs, dtype=values_T.dtype, device=values_T.device).index_add(
        0, seq_index_T, torch.ones_like(values_T)
    )
    return sums_S / counts_S.clamp_min(1.0)


def gspo_sequence_ratio(
    new_logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, seq_index_T: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """s_i = exp(mean over sequence i's tokens of (logp_new - logp_old)) -> [S]."""
    import torch

    mean_S = segment_mean(new_logprobs_T - old_logprobs_T, seq_index_T, num_seqs)
    return torch.exp(clamp_log_ratio(mean_S))


def gspo_sequence_loss(
    new_logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_S: torch.Tensor,
    seq_index_T: torch.Tensor,
    num_seqs: int,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence loss [S], clipped indicator [S])."""
    import torch

    ratio_S = gspo_sequence_ratio(new_logprobs_T, old_logprobs_T, seq_index_T, num_seqs)
    clipped_S = ratio_S.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_S = -torch.minimum(ratio_S * advantages_S, clipped_S * advantages_S)
    return loss_S, clip_indicator(ratio_S.detach(), eps_low, eps_high)


def kl_k3(new_logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(new || ref) on samples from new: e^(ref-new) - (ref-new) - 1."""
    import torch

    delta_T = clamp_log_ratio(ref_logprobs_T - new_logprobs_T)
    return torch.exp(delta_T) - delta_T - 1.0


def aggregate(
    loss_T: torch.Tensor,
    seq_index_T: torch.Tensor,
    seq_lengths_S: torch.Tensor,
    mode: Literal["token", "sequence"],
    total_tokens: int,
    total_seqs: int,
) -> torch.Tensor:
    """Sum of this micro-batch's share of the batch loss (token- or sequence-mean over the batch).

    `seq_lengths_S` are the token counts of this micro-batch's sequences; `total_tokens` and
    `total_seqs` count the whole step's batch, so summing over micro-batches gives the batch mean.
    """
    if mode == "token":
        return loss_T.sum() / max(total_tokens, 1)
    per_token_weight_T = 1.0 / seq_lengths_S.clamp_min(1).to(loss_T.dtype)[seq_index_T]
    return (loss_T * per_token_weight_T).sum() / max(total_seqs, 1)


def aggregate_sequences(
    loss_S: torch.Tensor,
    seq_lengths_S: torch.Tensor,
    mode: Literal["token", "sequence"],
    total_tokens: int,
    total_seqs: int,
) -> torch.Tensor:
    """Sequence-level losses (GSPO): "token" weights each sequence by its length."""
    if mode == "token":
        return (loss_S * seq_lengths_S.to(loss_S.dtype)).sum() / max(total_tokens, 1)
    return loss_S.sum() / max(total_seqs, 1)
