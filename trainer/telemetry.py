"""Per-step metrics: one JSON line per step in run_dir/metrics.jsonl, and Prometheus gauges.

metrics.jsonl describes the lineage of the current weights: on resume it is cut back to the
checkpoint's step (atomically), so a restarted run never shows a step twice. The same holds for
trained_rollouts.jsonl (step -> rollout ids applied), which makes "no rollout applied twice, none
lost" checkable from the outside, and for samples.jsonl (a few completions per step, which the run
trackers show as tables).

Gauges are `parity_trainer_<name>` for every numeric metric in REQUIRED_METRICS plus a few extras;
totals are counters (`_total`). No labels (the lag histogram stays in the JSON). A metric the step
could not measure (NaN, e.g. lag-0 mismatch in a step without lag-0 tokens) is `null` in the JSON
and NaN in its gauge, never the previous step's value; a metric the step leaves out (own-version
scoring off) is absent from the JSON and NaN in its gauge, never the gauge's initial 0.0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.checkpoint import atomic_write_text

REQUIRED_METRICS = (
    "step",
    "weight_version",
    "reward_mean",
    "reward_std",
    "clip_rate",
    "kl_new_old",
    "entropy",
    "mismatch_k1",
    "mismatch_k2",
    "mismatch_k3",
    "mismatch_max_abs",
    "mismatch_ratio_p05",
    "mismatch_ratio_p50",
    "mismatch_ratio_p95",
    "mismatch_k1_own_version",
    "mismatch_k3_own_version",
    "mismatch_max_abs_own_version",
    "mismatch_k3_own_version_informative",
    "own_version_informative_tokens",
    "policy_drift_k1",
    "policy_drift_k2",
    "policy_drift_k3",
    "policy_drift_max_abs",
    "policy_drift_ratio_p05",
    "policy_drift_ratio_p50",
    "policy_drift_ratio_p95",
    "ess",
    "lag_mean",
    "lag_max",
    "lag_hist",
    "dropped_stale",
    "tokens_per_s",
    "step_time_s",
    "lag0_token_frac",
)
EXTRA_GAUGES = (
    "loss",
    "grad_norm",
    "lr",
    "num_tokens",
    "num_sequences",
    "zero_variance_groups",
    "duplicates_skipped",
    "is_weight_mean",
    "is_corrected_frac",
    "kl_ref",
    "queue_wait_s",
    "publish_s",
    "trainer_nonfinite_tokens",
    "mismatch_nonfinite_tokens",
    "policy_drift_nonfinite_tokens",
    "mismatch_k3_mixed_context",
    "version_tag_violations",
    "mismatch_tokens",
    "mismatch_nonfinite_tokens_own_version",
    "own_version_tokens",
    "own_version_score_s",
    "backlog",
    "head_gaps",
    "head_low_precision",
    "head_grid_exponent",
)
COUNTERS = ("rollouts_trained", "dropped_stale", "duplicates_skipped")
# Gauges the trainer sets outside a step's metrics (Telemetry.set_gauge, at each publish).
SET_BETWEEN_STEPS = ("weight_version", "publish_s")


def prometheus_name(name: str) -> str:
    """Prometheus spells units out: step_time_s -> step_time_seconds, tokens_per_s -> ..._per_second."""
    if name.endswith("_per_s"):
        return name[: -len("s")] + "second"
    return name[: -len("_s")] + "_seconds" if name.endswith("_s") else name


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_lineage(path: Path, max_step: int) -> list[str]:
    """JSON lines of `path` with step <= max_step (a torn last line is dropped)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= max_step:
            kept.append(line)
    return kept


def truncate_to_step(path: Path, max_step: int) -> None:
    """Atomically keep only lines with step <= max_step."""
    if not path.exists():
        return
    lines = read_lineage(path, max_step)
    atomic_write_text(path, "".join(f"{line}\n" for line in lines))


class Telemetry:
    """Writes metrics.jsonl / trained_rollouts.jsonl and updates Prometheus gauges."""

    def __init__(self, run_dir: str | Path, prometheus: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.rollouts_path = self.run_dir / "trained_rollouts.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        if prometheus:
            self._register()

    def _register(self) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        for name in (*REQUIRED_METRICS, *EXTRA_GAUGES):
            if name == "lag_hist" or name in COUNTERS:
                continue
            full = f"parity_trainer_{prometheus_name(name)}"
            existing = REGISTRY._names_to_collectors.get(full)  # re-created in-process by tests
            self._gauges[name] = existing or Gauge(full, f"Trainer metric {name} (see docs/trainer.md)")
            self._gauges[name].set(math.nan)  # nothing measured yet
        for name in COUNTERS:
            full = f"parity_trainer_{name}"
            existing = REGISTRY._names_to_collectors.get(
                f"{full}_total"
            ) or REGISTRY._names_to_collectors.get(full)
            self._counters[name] = existing or Counter(full, f"Trainer total {name}")

    def resume(self, step: int) -> None:
        truncate_to_step(self.metrics_path, step)
        truncate_to_step(self.rollouts_path, step)
        truncate_to_step(self.samples_path, step)

    def record(
        self,
        metrics: Mapping[str, Any],
        rollout_ids: list[str],
        counter_increments: Mapping[str, int],
        samples: list[dict] = (),
    ) -> None:
        """Append the step's lines (rollouts first: a torn metrics line never hides a trained step)."""
        step = int(metrics["step"])
        with open(self.rollouts_path, "a") as handle:
            handle.write(json.dumps({"step": step, "rollout_ids": rollout_ids}) + "\n")
        if samples:
            with open(self.samples_path, "a") as handle:
                handle.write("".join(json.dumps({"step": step, **sample}) + "\n" for sample in samples))
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
        for name, gauge in self._gauges.items():
            value = metrics.get(name)
            if isinstance(value, (int, float)):
                gauge.set(float(value))  # NaN: not measured in this step
            elif name not in SET_BETWEEN_STEPS:
                # Absent from the step (own-version scoring off: own_version_groups 0): NaN, never
                # the gauge's initial 0.0 or an earlier step's value.
                gauge.set(math.nan)
        for name, amount in counter_increments.items():
            if name in self._counters and amount > 0:
                self._counters[name].inc(amount)

    def set_gauge(self, name: str, value: float) -> None:
        if name in self._gauges:
            self._gauges[name].set(value)
