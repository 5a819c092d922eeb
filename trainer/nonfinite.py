"""Steps whose gradient norm is not finite.

Such a step takes no optimizer step. Its rollouts are acknowledged but dropped, not trained: they
go to skipped_rollouts.jsonl (never to trained_rollouts.jsonl or the dedupe set) and are counted
(skipped_nonfinite, skipped_nonfinite_steps_total, rollouts_skipped_nonfinite in metrics.jsonl).
They are not re-trained, because the same batch would most likely give the same gradient again.
`trainer.max_nonfinite_steps` such steps in a row stop the run (NonFiniteStepsError, exit 1).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SKIPPED_ROLLOUTS_FILE = "skipped_rollouts.jsonl"


class NonFiniteStepsError(RuntimeError):
    """`trainer.max_nonfinite_steps` steps in a row had a non-finite gradient: training stops."""


def record_skipped_step(
    run_dir: Path, step: int, rollout_ids: list[str], grad_norm: float, in_a_row: int, limit: int
) -> None:
    """Append the step's rollouts to skipped_rollouts.jsonl; raise once `limit` steps in a row were."""
    with open(run_dir / SKIPPED_ROLLOUTS_FILE, "a") as handle:
        handle.write(
            json.dumps({"step": step, "reason": "nonfinite_gradient", "rollout_ids": rollout_ids}) + "\n"
        )
    log.warning(
        "step %d skipped: gradient norm %s; its %d rollouts are dropped (%d in a row, limit %d)",
        step,
        grad_norm,
        len(rollout_ids),
        in_a_row,
        limit,
    )
    if in_a_row >= limit:
        raise NonFiniteStepsError(
            f"{in_a_row} steps in a row (up to step {step}) had a non-finite gradient "
            f"norm (trainer.max_nonfinite_steps={limit}); stopping. Their rollouts are in "
            f"{run_dir / SKIPPED_ROLLOUTS_FILE}; the weights are those of the last finite step."
        )
