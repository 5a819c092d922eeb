"""Per-token train-inference mismatch for `parity check`: the worst tokens and the table.

Every number is over completion tokens sampled by the rollout engine (distribution q, "rollout")
and rescored by the trainer (distribution p, "trainer"), with the same weights on both sides. The
numbers themselves come from the core (parity/mismatch.py: k1/k2/k3, |r|, ratio quantiles, ESS,
non-finite counts), the same function as the trainer's per-step `mismatch_*` metrics, so a
preflight number and the lag-0 curve of a run mean the same thing. This module adds only what a
check reports beyond them: the flattening of completions, the worst tokens decoded with their
context, and the fixed-width table.

Invariants:
  - A non-finite logprob (e.g. a token the trainer's top-k/top-p mask excludes, i.e. the engine
    sampled outside the distribution the trainer replays) is counted per side and left out of the
    statistics, never clamped; it fails the gate on its own (commands/check/check.py) and ranks first
    among the worst tokens.
  - An empty set of completion tokens is an error: nothing was checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from parity.mismatch import MismatchStats, finite_log_ratios, mismatch_stats


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
    """(trainer [N], rollout [N]) float64, in completion then position order."""
    trainer = [lp for c in completions for lp in c.trainer_logprobs]
    rollout = [lp for c in completions for lp in c.rollout_logprobs]
    return np.asarray(trainer, dtype=np.float64), np.asarray(rollout, dtype=np.float64)


def completion_stats(completions: Sequence[ScoredCompletion]) -> MismatchStats:
    """The core's statistics over every token of `completions`; no token at all is an error."""
    trainer_N, rollout_N = flat_logprobs(completions)
    if trainer_N.size == 0:
        raise ValueError("no completion tokens to compare: every completion was empty")
    return mismatch_stats(trainer_N, rollout_N)


def completion_log_ratios(completions: Sequence[ScoredCompletion]) -> np.ndarray:
    """r over the tokens where both sides are finite: what the statistics and the histogram use."""
    return finite_log_ratios(*flat_logprobs(completions))


def worst_tokens(
    completions: Sequence[ScoredCompletion],
    decode: Callable[[Sequence[int]], str],
    k: int = 8,
    context_tokens: int = 12,
) -> list[WorstToken]:
    """The k tokens with the largest |r| (non-finite r first), decoded, each with the
    `context_tokens` before it."""
    scored: list[tuple[bool, float, int, int]] = []
    for ci, comp in enumerate(completions):
        for t, (rollout_lp, trainer_lp) in enumerate(
            zip(comp.rollout_logprobs, comp.trainer_logprobs, strict=True)
        ):
            r = float(trainer_lp) - float(rollout_lp)  # inf - inf is NaN: non-finite all the same
            finite = math.isfinite(r)
            scored.append((finite, -abs(r) if finite else 0.0, ci, t))
    scored.sort()
    out = []
    for _, _, ci, t in scored[:k]:
        comp = completions[ci]
        before = (comp.prompt_token_ids + comp.token_ids[:t])[-context_tokens:]
        rollout_lp, trainer_lp = float(comp.rollout_logprobs[t]), float(comp.trainer_logprobs[t])
        out.append(
            WorstToken(
                prompt_index=comp.prompt_index,
                position=t,
                token_id=int(comp.token_ids[t]),
                token_text=decode([comp.token_ids[t]]),
                context_text=decode(list(before)),
                rollout_logprob=rollout_lp,
                trainer_logprob=trainer_lp,
                log_ratio=trainer_lp - rollout_lp,
            )
        )
    return out


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
