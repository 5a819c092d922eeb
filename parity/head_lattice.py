"""Does an engine compute its logits in float32? A test on its top logprobs, blind to everything else.

Logprob comparison cannot always tell a bfloat16 lm_head from a float32 one: under bf16 rollouts the
body's own rounding already moves every logprob by about as much (docs/ab_study.md). The head's
output format can be seen directly, though. Within one position, every processed logprob is
`z / T - lse` with one shared `lse`, so the gap between two of them, times the temperature, is the
gap between two logits `z`. A bfloat16 logit keeps 8 significant bits: one of magnitude in
[2^e, 2^(e+1)) is a multiple of 2^(e-7), so the gaps between a position's top logits are multiples
of a coarse power of two (2^-5 on the tiny model, 2^-3 on SmolLM2-135M). Float32 logits keep 24 bits
and their gaps fall on such a grid only by chance, 2 x tolerance / spacing of the time.

`head_lattice` takes the top logprobs of many positions and finds the coarsest grid 2^-m (m <= 12)
that most gaps lie on beyond chance: found, the logits were rounded to a low-precision format
(bfloat16, float16) before the logprobs were taken.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# A gap is "on" a grid when it is this close to a multiple of the spacing: above float32's rounding
# of logprobs down to about -30 (a few 1e-6) and well below the finest spacing tested (2^-12).
TOLERANCE = 1e-5
FINEST = 12  # spacings 2^0 ... 2^-12; at 2^-12 chance is already 8 %
MIN_GAPS = 32  # fewer gaps decide nothing
# The share of gaps, beyond chance, that must lie on one grid: bf16 logits put 99-100 % on theirs
# (tiny, SmolLM2-135M), float32 logits no more than chance on any (docs/ab_study.md).
ON_GRID = 0.9


@dataclass(frozen=True)
class HeadLattice:
    """What the top logprobs say about the precision of the logits they were computed from."""

    gaps: int  # non-zero gaps between a position's most likely logprob and the others
    exponent: int | None  # the coarsest grid 2^-exponent that most gaps lie on; None: no grid
    on_grid: float  # the share of gaps on that grid (NaN without a grid or without gaps)
    chance: float  # the share that float32 logits put on that grid by chance (NaN without a grid)

    @property
    def measured(self) -> bool:
        return self.gaps >= MIN_GAPS

    @property
    def low_precision(self) -> bool:
        """The logits were rounded to a format coarser than float32 before the logprobs."""
        return self.measured and self.exponent is not None

    def describe(self) -> str:
        if not self.measured:
            return f"head precision: not measured ({self.gaps} top-logprob gaps, {MIN_GAPS} needed)"
        if self.exponent is None:
            return f"head precision: float32-like ({self.gaps} top-logprob gaps on no power-of-two grid)"
        return (
            f"head precision: LOW: {self.on_grid:.1%} of {self.gaps} top-logprob gaps are multiples of "
            f"2^-{self.exponent} (float32 logits: {self.chance:.2%}); the engine's logits were rounded to "
            "bfloat16/float16 (is its lm_head in float32?)"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "gaps": self.gaps,
            "exponent": self.exponent,
            "on_grid": None if math.isnan(self.on_grid) else self.on_grid,  # JSON has no NaN
            "chance": None if math.isnan(self.chance) else self.chance,
            "measured": self.measured,
            "low_precision": self.low_precision,
        }


def logit_gaps(top_logprobs: Iterable[Sequence[float]], temperature: float) -> np.ndarray:
    """Per position, the most likely logprob minus each other finite one, times the temperature (the
    logit gaps); zero gaps (ties) are left out, as they lie on every grid."""
    scale = temperature if temperature > 0 else 1.0
    gaps: list[float] = []
    for values in top_logprobs:
        finite = sorted((float(v) for v in values if math.isfinite(v)), reverse=True)
        gaps.extend((finite[0] - v) * scale for v in finite[1:] if finite[0] != v)
    return np.asarray(gaps, dtype=np.float64)


def head_lattice(top_logprobs: Iterable[Sequence[float]], temperature: float) -> HeadLattice:
    """`top_logprobs`: per position, the logprobs of its most likely tokens (any order) under the
    processed distribution at `temperature` (0, greedy, reads as 1)."""
    return lattice_of_gaps(logit_gaps(top_logprobs, temperature))


def lattice_of_gaps(gaps: np.ndarray) -> HeadLattice:
    """The test on logit gaps already taken (non-zero, times the temperature): `logit_gaps`."""
    if len(gaps) == 0:
        return HeadLattice(0, None, math.nan, math.nan)
    for exponent in range(FINEST + 1):
        spacing = 2.0**-exponent
        chance = min(1.0, 2 * TOLERANCE / spacing)
        off = np.abs(gaps / spacing - np.round(gaps / spacing)) * spacing
        on_grid = float(np.mean(off < TOLERANCE))
        if (on_grid - chance) / (1 - chance) >= ON_GRID:
            return HeadLattice(len(gaps), exponent, on_grid, chance)
    return HeadLattice(len(gaps), None, math.nan, math.nan)
