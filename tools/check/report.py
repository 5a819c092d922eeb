"""Per-token train-inference mismatch for `parity check`: the numbers, the worst tokens, the table.

Every number is over completion tokens sampled by the rollout engine (distribution q, "rollout")
and rescored by the trainer (distribution p, "trainer"), with the same weights on both sides.
Definitions are the trainer's per-step ones (parity/mismatch.py), so a preflight number and the
lag-0 `mismatch_*` curve of a run mean the same thing:

    r   = logp_trainer - logp_rollout          (log importance ratio p/q of each token)
    k1  = mean(-r)      k2 = mean(r²/2)       k3 = mean(e^r - 1 - r)   (estimates of KL(q || p))
    ratio quantiles: of w = e^r;  mean_abs / max_abs: of |r|;  ess = (Σw)² / (N Σw²)

Invariants:
  - The statistics are over tokens where both logprobs are finite. A non-finite logprob (a token
    the trainer's top-k/top-p mask excludes, i.e. the engine sampled outside the distribution the
    trainer replays) is counted per side, never dropped silently, and fails the gate on its own
    (see tools/check/check.py). The trainer's per-step metric instead clamps such a token's r to ±20;
    that one token would then dominate every mean, and hide how large the numeric error is.
  - Arithmetic is float64 on numpy; inputs are the float32 logprobs the two sides reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

MAX_LOG_RATIO = 20.0
RATIO_QUANTILES = (("p01", 0.01), ("p05", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclass(frozen=True)
class ScoredCompletion:
    """One completion with both sides' logprobs for each of its tokens."""

    prompt_index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    trainer_logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.rollout_logprobs) == len(self.trainer_logprobs):
            raise ValueError(
                f"completion of prompt {self.prompt_index}: {len(self.token_ids)} tokens, "
                f"{len(self.rollout_logprobs)} rollout and {len(self.trainer_logprobs)} trainer logprobs"
            )


@dataclass(frozen=True)
class MismatchStats:
    """Summary of r = logp_trainer - logp_rollout over all completion tokens."""

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

    @property
    def nonfinite(self) -> int:
        return self.nonfinite_rollout + self.nonfinite_trainer

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True)
class WorstToken:
    """A token with one of the largest |r|, decoded, with the text just before it."""

    prompt_index: int
    position: int
    token_id: int
    token_text: str
    context_text: str
    rollout_logprob: float
    trainer_logprob: float
    log_ratio: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def flat_logprobs(completions: Sequence[ScoredCompletion]) -> tuple[np.ndarray, np.ndarray]:
    """(rollout [N], trainer [N]) float64, in completion then position order."""
    rollout = [lp for c in completions for lp in c.rollout_logprobs]
    trainer = [lp for c in completions for lp in c.trainer_logprobs]
    return np.asarray(rollout, dtype=np.float64), np.asarray(trainer, dtype=np.float64)


def log_ratios(rollout_N: np.ndarray, trainer_N: np.ndarray) -> np.ndarray:
    """r = trainer - rollout, non-finite values mapped to ±MAX_LOG_RATIO (NaN to 0), then clamped."""
    with np.errstate(invalid="ignore"):
        r_N = trainer_N - rollout_N
    r_N = np.nan_to_num(r_N, nan=0.0, posinf=MAX_LOG_RATIO, neginf=-MAX_LOG_RATIO)
    return np.clip(r_N, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def mismatch_stats(completions: Sequence[ScoredCompletion]) -> MismatchStats:
    """All the numbers of the module docstring; an empty input is an error (nothing was checked)."""
    rollout_N, trainer_N = flat_logprobs(completions)
    if rollout_N.size == 0:
        raise ValueError("no completion tokens to compare: every completion was empty")
    finite_N = np.isfinite(rollout_N) & np.isfinite(trainer_N)
    r_N = trainer_N[finite_N] - rollout_N[finite_N]
    if r_N.size == 0:
        r_N = np.full(1, MAX_LOG_RATIO)  # nothing finite: report the clamp, the gate fails anyway
    w_N = np.exp(r_N)
    quantiles = np.quantile(w_N, [q for _, q in RATIO_QUANTILES])
    return MismatchStats(
        tokens=int(rollout_N.size),
        mean_abs=float(np.abs(r_N).mean()),
        max_abs=float(np.abs(r_N).max()),
        k1=float((-r_N).mean()),
        k2=float((0.5 * r_N * r_N).mean()),
        k3=float((w_N - 1.0 - r_N).mean()),
        **{f"ratio_{name}": float(v) for (name, _), v in zip(RATIO_QUANTILES, quantiles, strict=True)},
        ess=float(w_N.sum() ** 2 / (w_N.size * (w_N * w_N).sum())),
        nonfinite_rollout=int((~np.isfinite(rollout_N)).sum()),
        nonfinite_trainer=int((~np.isfinite(trainer_N)).sum()),
    )


def worst_tokens(
    completions: Sequence[ScoredCompletion],
    decode: Callable[[Sequence[int]], str],
    k: int = 8,
    context_tokens: int = 12,
) -> list[WorstToken]:
    """The k tokens with the largest |r|, decoded, each with the `context_tokens` before it."""
    scored: list[tuple[float, int, int]] = []
    for ci, comp in enumerate(completions):
        r_T = log_ratios(
            np.asarray(comp.rollout_logprobs, dtype=np.float64),
            np.asarray(comp.trainer_logprobs, dtype=np.float64),
        )
        scored.extend((abs(float(r)), ci, t) for t, r in enumerate(r_T))
    scored.sort(key=lambda item: -item[0])
    out = []
    for _, ci, t in scored[:k]:
        comp = completions[ci]
        before = (comp.prompt_token_ids + comp.token_ids[:t])[-context_tokens:]
        rollout_lp, trainer_lp = comp.rollout_logprobs[t], comp.trainer_logprobs[t]
        out.append(
            WorstToken(
                prompt_index=comp.prompt_index,
                position=t,
                token_id=int(comp.token_ids[t]),
                token_text=decode([comp.token_ids[t]]),
                context_text=decode(list(before)),
                rollout_logprob=float(rollout_lp),
                trainer_logprob=float(trainer_lp),
                log_ratio=float(log_ratios(np.array([rollout_lp]), np.array([trainer_lp]))[0]),
            )
        )
    return out


def finite_log_ratios(completions: Sequence[ScoredCompletion]) -> np.ndarray:
    """r over tokens where both sides are finite: what the statistics and the histogram use."""
    rollout_N, trainer_N = flat_logprobs(completions)
    finite = np.isfinite(rollout_N) & np.isfinite(trainer_N)
    return trainer_N[finite] - rollout_N[finite]


def _num(value: float) -> str:
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.2e}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.4f}"


TABLE_COLUMNS = (
    "config",
    "tokens",
    "mean|Δ|",
    "max|Δ|",
    "k1",
    "k2",
    "k3",
    "ratio p05/p50/p95",
    "nonfin",
    "gate",
)


def format_table(rows: Sequence[tuple[str, MismatchStats, str]]) -> str:
    """A fixed-width table, one row per (config label, stats, gate verdict)."""
    cells = [list(TABLE_COLUMNS)]
    for label, s, verdict in rows:
        cells.append(
            [
                label,
                str(s.tokens),
                _num(s.mean_abs),
                _num(s.max_abs),
                _num(s.k1),
                _num(s.k2),
                _num(s.k3),
                f"{s.ratio_p05:.3f}/{s.ratio_p50:.3f}/{s.ratio_p95:.3f}",
                f"{s.nonfinite_rollout}/{s.nonfinite_trainer}",
                verdict,
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_worst(tokens: Sequence[WorstToken]) -> str:
    """One line per worst token: where, which, both logprobs."""
    lines = ["worst tokens (r = trainer - rollout):"]
    for w in tokens:
        lines.append(
            f"  prompt {w.prompt_index:>3} pos {w.position:>3}  r={w.log_ratio:+.3e}  "
            f"rollout {w.rollout_logprob:.4f}  trainer {w.trainer_logprob:.4f}  "
            f"token {w.token_text!r} after ...{w.context_text!r}"
        )
    return "\n".join(lines)
