"""Off-policy accounting by weight version, and the (off-by-default) IS corrections.

- Lag of a token = trainer version - the version that sampled it. Never negative in a healthy
  pipeline; a negative lag (a token from a version the trainer has not published) is an error the
  caller counts.
- `max_lag`: an entry whose *oldest* token is more than `max_lag` versions behind is dropped whole
  and counted (`dropped_stale`); a group is the unit of GRPO normalisation, so partial groups are
  not trained.
- Corrections (only once backend parity holds, see docs/trainer.md). With log-ratio
  δ = logp_proximal - logp_behaviour (the trainer's current logprob, detached, vs the rollout's):
    TIS: w = min(e^δ, cap)             MIS: w = e^δ if e^δ <= cap else 0
  per token, or per sequence with δ summed over the sequence's tokens (the sequence likelihood
  ratio) and the same w applied to every token of the sequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from trainer.objectives import clamp_log_ratio

if TYPE_CHECKING:
    import torch


def token_lags(trainer_version: int, token_versions: Sequence[int]) -> list[int]:
    """trainer_version - token_version for each token."""
    return [int(trainer_version) - int(v) for v in token_versions]


def entry_lag(trainer_version: int, min_weight_version: int) -> int:
    """The lag of the entry's oldest token."""
    return int(trainer_version) - int(min_weight_version)


def is_stale(trainer_version: int, min_weight_version: int, max_lag: int) -> bool:
    return entry_lag(trainer_version, min_weight_version) > max_lag


def lag_histogram(lags: Iterable[int]) -> dict[str, int]:
    """{"0": count, "1": count, ...}, keys sorted numerically."""
    counts = Counter(int(lag) for lag in lags)
    return {str(k): counts[k] for k in sorted(counts)}


def is_weights(
    proximal_logprobs_T: torch.Tensor,
    behaviour_logprobs_T: torch.Tensor,
    seq_index_T: torch.Tensor,
    num_seqs: int,
    kind: Literal["none", "tis", "mis"],
    level: Literal["token", "sequence"],
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T] without gradient, corrected indicator [T]: 1 where truncated or masked)."""
    import torch

    with torch.no_grad():
        delta_T = (proximal_logprobs_T - behaviour_logprobs_T).float()
        if level == "sequence":
            delta_S = torch.zeros(num_seqs, dtype=delta_T.dtype, device=delta_T.device).index_add(
                0, seq_index_T, delta_T
            )
            delta_T = delta_S[seq_index_T]
        raw_T = torch.exp(clamp_log_ratio(delta_T))
        if kind == "none":
            return torch.ones_like(raw_T), torch.zeros_like(raw_T)
        over_T = raw_T > cap
        if kind == "tis":
            return raw_T.clamp(max=cap), over_T.float()
        return torch.where(over_T, torch.zeros_like(raw_T), raw_T), over_T.float()
