"""The running head-precision test: the preflight's top-logprob test, on the rollouts themselves.

Logprob comparison cannot tell a bfloat16 lm_head from a float32 one under bf16 rollouts (the body's
rounding moves every logprob by as much, docs/ab_study.md); the preflight sees it in the engine's top
logprobs (parity/head_lattice.py). During training the same evidence is already in every group:
its samples share the prompt, and where two of them have sampled the same tokens so far (at the
same weight and context versions) and then sample different ones, both logprobs come from one
processed distribution, so their difference times the temperature is the gap between two logits.
A float32 head puts such gaps on no power-of-two grid; a bfloat16 or float16 head puts nearly all
on one. Nothing is added to the request or the wire.

The watch keeps the most recent WINDOW gaps and judges them with `lattice_of_gaps` after every
step. When it finds a grid where the run expects a float32 head (`rollout.head_dtype float32`, or
float32 rollouts), `check.on_mismatch` decides, as for the mismatch gate: `stop` raises
`MismatchGateError`, `warn` logs once.

Invariants:
  - Only a sample's tokens before its first environment token count (an observation changes what
    follows); greedy groups give nothing.
  - Not measured (metrics NaN) until head_lattice.MIN_GAPS gaps are in the window; the window is not
    checkpointed (a resumed trainer fills it again).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from parity.head_lattice import HeadLattice, lattice_of_gaps, logit_gaps
from parity.v1 import rollouts_pb2
from trainer.mismatch_gate import MismatchGateError

log = logging.getLogger(__name__)

WINDOW = 256  # gaps judged together: a few steps' worth at 8 samples per group
HEAD_TEST = "running head test"  # how its stop and warning begin


def sibling_rows(group: rollouts_pb2.RolloutGroup) -> list[list[float]]:
    """Per shared context of the group's samples: the logprobs of the different tokens they sampled
    there (one row per context where at least two differ)."""
    # Each sample's fields are read in place, position by position, only as deep as some sibling
    # still shares its prefix: siblings part within a few tokens, so the walk never reads most of a
    # completion (copying every token first cost ~28 ms a step at 64 x 896 tokens).
    paths = []
    for sample in group.samples:
        n = min(len(sample.token_ids), len(sample.logprobs))
        if sample.loss_mask:  # an episode: its first model turn only
            n = min(n, next((i for i, model in enumerate(sample.loss_mask) if not model), n))
        weights = sample.token_weight_versions
        contexts = sample.token_context_versions if len(sample.token_context_versions) else weights
        if len(weights) < n or len(contexts) < n:
            continue  # malformed: the consumer rejects such a sample anyway
        paths.append((n, sample.token_ids, weights, contexts, sample.logprobs))
    rows: list[list[float]] = []
    pending = [(list(range(len(paths))), 0)]  # samples that share every token before `depth`
    while pending:
        members, depth = pending.pop()
        # at this position: versions -> token -> the samples that sampled it
        branches: dict[tuple[int, int], dict[int, list[int]]] = {}
        for m in members:
            n, tokens, weights, contexts, _ = paths[m]
            if depth < n:
                branches.setdefault((weights[depth], contexts[depth]), {}).setdefault(
                    tokens[depth], []
                ).append(m)
        for by_token in branches.values():
            if len(by_token) > 1:
                rows.append([float(paths[same[0]][4][depth]) for same in by_token.values()])
            pending.extend((same, depth + 1) for same in by_token.values() if len(same) > 1)
    return rows


def sibling_gaps(groups: Iterable[rollouts_pb2.RolloutGroup]) -> np.ndarray:
    """The logit gaps (times each group's temperature) between siblings' tokens at shared contexts."""
    parts = [
        logit_gaps(sibling_rows(group), group.sampling.temperature)
        for group in groups
        if group.sampling.temperature > 0
    ]
    return np.concatenate(parts) if parts else np.zeros(0)


class HeadWatch:
    """The window of gaps, its verdict per step, and the action where a float32 head is expected."""

    def __init__(self, expect_float32: bool, action: Literal["warn", "stop"], window: int = WINDOW) -> None:
        self.expect_float32 = expect_float32
        self.action = action
        self.gaps: deque[float] = deque(maxlen=window)
        self.lattice = HeadLattice(0, None, math.nan, math.nan)
        self._warned = False

    def observe(self, groups: Iterable[rollouts_pb2.RolloutGroup]) -> dict[str, Any]:
        """Add a step's groups; the metrics `head_gaps` (in the window), `head_low_precision` (1 or 0,
        NaN until measured) and `head_grid_exponent` (m of the grid 2^-m, NaN without one)."""
        self.gaps.extend(sibling_gaps(groups).tolist())
        self.lattice = lattice = lattice_of_gaps(np.asarray(self.gaps, dtype=np.float64))
        return {
            "head_gaps": lattice.gaps,
            "head_low_precision": float(lattice.low_precision) if lattice.measured else math.nan,
            "head_grid_exponent": float(lattice.exponent)
            if lattice.low_precision and lattice.exponent is not None
            else math.nan,
        }

    def judge(self, step: int) -> str:
        """After `observe`: the warning issued at `step` ("" if none). Raises on `stop`."""
        if not (self.expect_float32 and self.lattice.low_precision):
            return ""
        message = (
            f"{HEAD_TEST} at step {step}: {self.lattice.describe()}; the run expects a float32 "
            "head (rollout.head_dtype float32, or float32 rollouts): the engine's logprobs are not the "
            "float32 ones the trainer compares them with"
        )
        if self.action == "stop":
            raise MismatchGateError(message)
        if not self._warned:
            self._warned = True
            log.warning("%s (check.on_mismatch=warn: training goes on)", message)
            return message
        return ""
