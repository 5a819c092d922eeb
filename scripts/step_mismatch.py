"""Print each step's reward and own-version mismatch from a run directory's metrics.jsonl.

    python3 scripts/step_mismatch.py RUN_DIR

Used by the GPU scripts (scripts/gpu_check.sh, scripts/gpu_smollm2_run.sh) to put the per-step k3 in
their logs. A run that wrote no metrics prints nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    metrics = Path(argv[0]) / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        row = json.loads(line)
        print("step", row.get("step"), "reward", row.get("reward_mean"), "own-version k3",
              row.get("mismatch_k3_own_version"), "max", row.get("mismatch_max_abs"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
