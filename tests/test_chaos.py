"""The chaos soak's short form (bench/chaos.py): a tiny sync run whose parts are SIGKILLed three
times at seeded random moments and resumed each time, then audited from its records and its Redis
stream (every step once, versions increasing, no rollout trained twice, every entry's draw
published once, skipped prompts within the in-flight bound, resumed workers caught up first).

The seed is drawn from `random` and printed; CHAOS_SEED=N replays one schedule. The long form
(`python bench/chaos.py --kills 50`) is a bench, run on demand (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from bench import chaos


@pytest.mark.slow
def test_three_random_kills_lose_nothing_and_train_nothing_twice(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(2**31)))
    print(f"kill schedule: CHAOS_SEED={seed}")
    plan = chaos.schedule(3, seed, "reference")
    steps = 20  # enough that the three kills land before the last step, short enough for the suite
    ran = chaos.soak(tmp_path / "run", plan, steps, "sync", "reference", seed)
    assert all(k["left_behind"] == 0 for k in ran["kills"]), ran["kills"]
    assert sum(k["what"].startswith("killed") for k in ran["kills"]) >= 2, ran["kills"]
    result = chaos.audit(tmp_path / "run", steps, 4, 2, len(ran["kills"]), in_flight=2)
    assert result["passed"], result["checks"]
