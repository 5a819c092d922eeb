"""Train-inference mismatch from per-token logprobs: the one implementation.

The trainer's per-step `mismatch_*` metrics (trainer/loop.py) and `parity check`
(commands/check/report.py) both call `mismatch_stats`, so a preflight number and a training curve
mean the same thing. With r = logp_trainer - logp_rollout on tokens sampled by the rollout engine
(distribution q) and rescored by the trainer (distribution p):

  k1 = mean(-r)                 unbiased KL(q || p) estimate (can be negative on a small sample)
  k2 = mean(r² / 2)             >= 0
  k3 = mean(e^r - 1 - r)        >= 0, unbiased
  mean_abs, max_abs             of |r|
  ratio_p01 ... ratio_p99       quantiles of w = e^r
  ess = (Σw)² / (N·Σw²)         1 when all weights are equal, -> 1/N when one dominates
All are 0 (ratios and ess 1) when the logprobs are identical.

Invariants:
  - A non-finite logprob is counted, never clamped or silently dropped: `nonfinite_tokens` is the
    number of tokens where either side is non-finite, with per-side counts beside it. A trainer
    -inf is a token the trainer's top-k/top-p mask excludes: the engine sampled outside the
    distribution the trainer replays.
  - The statistics are over the other tokens (`finite_tokens`). One clamped token would swamp every
    mean and hide how large the numeric error is.
  - With no finite token there is nothing to measure, and every statistic is NaN (not 0: zero would
    claim perfect parity).
  - Arithmetic is float64 on numpy, whatever the input (a sequence, a numpy array, a CPU tensor).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

RATIO_QUANTILES = (("p01", 0.01), ("p05", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclass(frozen=True)
class MismatchStats:
    """r = logp_trainer - logp_rollout summarised over the finite tokens of one token set."""

    tokens: int
    mean_abs: float
    max_abs: float
    k1: float
    k2: float
    k3: float
    ratio_p01: float
    ratio_p05: float
    ratio_p50: float
    ratio_p95: float
    ratio_p99: float
    ess: float
    nonfinite_rollout: int
    nonfinite_trainer: int
    nonfinite_tokens: int

    @property
    def finite_tokens(self) -> int:
        """The tokens the statistics are over."""
        return self.tokens - self.nonfinite_tokens

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _float64(logprobs: Any) -> np.ndarray:
    if hasattr(logprobs, "detach"):  # a torch tensor: never part of an autograd graph here
        logprobs = logprobs.detach().cpu()
    return np.asarray(logprobs, dtype=np.float64).reshape(-1)


def effective_sample_size(weights: Any) -> float:
    """(Σw)² / (N·Σw²) in [1/N, 1]; NaN for no weights (nothing to measure)."""
    w_N = _float64(weights)
    if w_N.size == 0:
        return math.nan
    return float(w_N.sum() ** 2 / (w_N.size * (w_N * w_N).sum()))


def finite_log_ratios(trainer_logprobs: Any, rollout_logprobs: Any) -> np.ndarray:
    """r = trainer - rollout over the tokens where both logprobs are finite (float64)."""
    trainer_N, rollout_N = _float64(trainer_logprobs), _float64(rollout_logprobs)
    if trainer_N.shape != rollout_N.shape:
        raise ValueError(f"{trainer_N.size} trainer logprobs for {rollout_N.size} rollout logprobs")
    finite_N = np.isfinite(trainer_N) & np.isfinite(rollout_N)
    return trainer_N[finite_N] - rollout_N[finite_N]


def mismatch_stats(trainer_logprobs: Any, rollout_logprobs: Any) -> MismatchStats:
    """All the numbers of the module docstring for one token set (the two logprobs of each token)."""
    trainer_N, rollout_N = _float64(trainer_logprobs), _float64(rollout_logprobs)
    r_N = finite_log_ratios(trainer_N, rollout_N)
    nonfinite_trainer_N, nonfinite_rollout_N = ~np.isfinite(trainer_N), ~np.isfinite(rollout_N)
    counts = {
        "tokens": int(trainer_N.size),
        "nonfinite_rollout": int(nonfinite_rollout_N.sum()),
        "nonfinite_trainer": int(nonfinite_trainer_N.sum()),
        "nonfinite_tokens": int((nonfinite_trainer_N | nonfinite_rollout_N).sum()),
    }
    if r_N.size == 0:
        unmeasured = ("mean_abs", "max_abs", "k1", "k2", "k3", "ess")
        return MismatchStats(
            **counts,
            **dict.fromkeys(unmeasured, math.nan),
            **{f"ratio_{name}": math.nan for name, _ in RATIO_QUANTILES},
        )
    w_N = np.exp(r_N)
    quantiles = np.quantile(w_N, [q for _, q in RATIO_QUANTILES])
    return MismatchStats(
        **counts,
        mean_abs=float(np.abs(r_N).mean()),
        max_abs=float(np.abs(r_N).max()),
        k1=float((-r_N).mean()),
        k2=float((0.5 * r_N * r_N).mean()),
        k3=float((w_N - 1.0 - r_N).mean()),
        **{f"ratio_{name}": float(v) for (name, _), v in zip(RATIO_QUANTILES, quantiles, strict=True)},
        ess=effective_sample_size(w_N),
    )
