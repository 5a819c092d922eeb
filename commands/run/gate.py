"""The running mismatch gate's threshold of a `parity run`, as the launcher gave it to the trainer.

With reduced precision and `check.gate_threshold` unset, the threshold comes from the clean k3 the
preflight measured (`trainer.mismatch_gate.running_threshold`), which config.json records under
"preflight"; the plots and `parity compare` read it from there, so the line they draw is the one
the trainer used.
"""

from __future__ import annotations

from typing import Any


def preflight_k3(preflight_record: dict | None) -> float | None:
    """The clean k3 the preflight measured (config.json's "preflight"), or None."""
    report = (preflight_record or {}).get("report") or {}
    rows = report.get("rows") or []
    k3 = rows[0].get("stats", {}).get("k3") if rows and isinstance(rows[0], dict) else None
    return float(k3) if isinstance(k3, int | float) else None


def run_threshold(cfg: Any, record: dict | None) -> tuple[float, str]:
    """(threshold, where it comes from) for a run's config and its config.json record."""
    from trainer.mismatch_gate import running_threshold

    return running_threshold(cfg, preflight_k3((record or {}).get("preflight")))
