"""Train-inference mismatch metrics from per-token logprobs (no gradient).

With r = logp_trainer - logp_rollout on tokens sampled by the rollout engine (distribution q):
  k1 = mean(-r)                 unbiased KL(q || p) estimate (can be negative on a small batch)
  k2 = mean(r² / 2)             >= 0
  k3 = mean(e^r - 1 - r)        >= 0, unbiased
  max_abs = max |r|, ratio quantiles of w = e^r (p05/p50/p95)
  ess = (Σw)² / (N·Σw²)         1 when all weights are equal, -> 1/N when one dominates
All are 0 (ess 1) when the logprobs are identical. Computed twice per step: on lag-0 tokens (backend
mismatch: same weights on both sides) and on all tokens (backend mismatch + staleness).
Non-finite trainer logprobs (a token the trainer's mask excludes) are counted, and their log-ratio
is clamped to ±20 so one token cannot turn every metric into inf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_LOG_RATIO = 20.0
QUANTILES = (("p05", 0.05), ("p50", 0.5), ("p95", 0.95))


def effective_sample_size(weights_T: torch.Tensor) -> float:
    """(Σw)² / (N·Σw²) in [1/N, 1]; 1.0 for an empty input."""
    weights_T = weights_T.double()
    n = weights_T.numel()
    if n == 0:
        return 1.0
    denom = float(n * (weights_T * weights_T).sum())
    return float(weights_T.sum() ** 2) / denom if denom > 0 else 0.0


def mismatch_metrics(trainer_logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor) -> dict[str, float]:
    """k1, k2, k3, max_abs, ratio_p05/p50/p95, ess, nonfinite, tokens (empty input: zeros)."""
    import torch

    with torch.no_grad():
        trainer_T = trainer_logprobs_T.detach().double()
        rollout_T = rollout_logprobs_T.detach().double()
        n = trainer_T.numel()
        if n == 0:
            out = dict.fromkeys(("k1", "k2", "k3", "max_abs", "nonfinite", "tokens"), 0.0)
            out.update({f"ratio_{name}": 1.0 for name, _ in QUANTILES})
            out["ess"] = 1.0
            return out
        nonfinite = int((~torch.isfinite(trainer_T) | ~torch.isfinite(rollout_T)).sum())
        r_T = torch.nan_to_num(trainer_T - rollout_T, nan=0.0, posinf=MAX_LOG_RATIO, neginf=-MAX_LOG_RATIO)
        r_T = r_T.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        w_T = torch.exp(r_T)
        quantiles = torch.quantile(w_T, torch.tensor([q for _, q in QUANTILES], dtype=w_T.dtype))
        out = {
            "k1": float((-r_T).mean()),
            "k2": float((0.5 * r_T * r_T).mean()),
            "k3": float((w_T - 1.0 - r_T).mean()),
            "max_abs": float(r_T.abs().max()),
            "ess": effective_sample_size(w_T),
            "nonfinite": float(nonfinite),
            "tokens": float(n),
        }
        for (name, _), value in zip(QUANTILES, quantiles.tolist(), strict=True):
            out[f"ratio_{name}"] = float(value)
        return out
