"""`parity compare RUN_DIR [RUN_DIR ...]`: overlay the runs' training curves, print final/mean values.

    parity compare runs/reference runs/vllm runs/vllm-broken --out compare.png

Reads each run directory's `metrics.jsonl` (one JSON object per trainer step; required) and
`config.json` (the resolved configuration `parity run` writes; optional). Draws one panel per
metric the source post plotted (clip rate, kl_new_old, entropy, reward) plus the lag-0 mismatch
(k3) and the staleness (mean lag), one line per run, x = trainer step. Runs are labelled by the
config settings in which they differ (from `config.json`'s "run" section when present), or by
directory name when their configs agree or are missing.

Invariants: a missing directory, a directory without a non-empty metrics.jsonl, or a malformed line
is an error that names the file (exit 2), never a silently empty curve. A metric a run does not
log is left out of that run's panel and shown as "-" in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# (metrics.jsonl key, panel title, log-scale y)
METRICS = (
    ("clip_rate", "clip rate", False),
    ("kl_new_old", "kl_new_old", False),
    ("entropy", "entropy", False),
    ("reward_mean", "reward (mean)", False),
    ("mismatch_k3", "mismatch k3 (lag-0 tokens)", True),
    ("lag_mean", "lag (mean, versions)", False),
)
# Config keys that differ between any two runs and say nothing about the method.
IGNORED_KEYS = frozenset(
    {
        "out",
        "redis_url",
        "argv",
        "run_dir",
        "marker",
        "startup_timeout_s",
        "step_timeout_s",
        "i_know_the_mismatch_is_high",
        "skip_preflight",
        "progress_interval_s",
    }
)
MAX_LABEL_KEYS = 6


class CompareError(ValueError):
    """Bad input; the message names the run directory or file."""


@dataclass
class Run:
    path: Path
    rows: list[dict]
    config: dict
    label: str = ""

    def series(self, key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for i, row in enumerate(self.rows):
            value = row.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                xs.append(float(row.get("step", i + 1)))
                ys.append(float(value))
        return xs, ys


def load_run(path: Path) -> Run:
    if not path.is_dir():
        raise CompareError(f"{path}: no such run directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise CompareError(
            f"{path}: no metrics.jsonl (is this a `parity run` directory, and did it take a step?)"
        )
    rows = []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CompareError(f"{metrics}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise CompareError(f"{metrics}:{number}: expected a JSON object per line")
        rows.append(row)
    if not rows:
        raise CompareError(f"{metrics}: empty; the run logged no steps")
    config: dict = {}
    config_path = path / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise CompareError(f"{config_path}: not JSON ({exc.msg})") from None
    return Run(path, rows, config if isinstance(config, dict) else {})


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(value) if isinstance(value, list) else value}


def label_runs(runs: Sequence[Run]) -> None:
    """Set each run's label to the settings where the runs differ (`key=value, ...`)."""
    flat = [_flatten(r.config.get("run", r.config)) for r in runs]
    keys = sorted({k for f in flat for k in f if k.split(".")[-1] not in IGNORED_KEYS})
    differing = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat}) > 1]
    names = [r.path.name or str(r.path) for r in runs]
    for run, f, name in zip(runs, flat, names, strict=True):
        if not differing or not run.config:
            run.label = name
            continue
        parts = [f"{k}={f.get(k, '-')}" for k in differing[:MAX_LABEL_KEYS]]
        if len(differing) > MAX_LABEL_KEYS:
            parts.append(f"+{len(differing) - MAX_LABEL_KEYS} more")
        run.label = ", ".join(parts)
    if len(set(r.label for r in runs)) < len(runs):  # equal settings (e.g. seeds only): add the dir
        for run, name in zip(runs, names, strict=True):
            run.label = name if run.label == name else f"{name}: {run.label}"
    if len(set(r.label for r in runs)) < len(runs):  # the same directory twice
        for index, run in enumerate(runs):
            run.label = f"{run.label} #{index + 1}"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def summary_table(runs: Sequence[Run]) -> str:
    """One block per metric: final and mean value for each run."""
    header = ["metric", "run", "steps", "final", "mean"]
    cells = [header]
    for key, _, _ in METRICS:
        for run in runs:
            _, ys = run.series(key)
            cells.append(
                [
                    key,
                    run.label,
                    str(len(ys)),
                    _fmt(ys[-1] if ys else None),
                    _fmt(sum(ys) / len(ys) if ys else None),
                ]
            )
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs: Sequence[Run], out: Path):
    """The overlay figure (2 x 3 panels, one line per run per panel); returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True)
    for ax, (key, title, log_y) in zip(axes.flat, METRICS, strict=True):
        for run in runs:
            xs, ys = run.series(key)
            if ys:
                ax.plot(xs, ys, marker="." if len(ys) < 30 else None, label=run.label)
        ax.set_title(title)
        if log_y and any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("trainer step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if not handles:
        for ax in axes.flat:
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                break
    wide = max((len(label) for label in labels), default=0) > 45
    ncol = 1 if wide else min(len(labels), 3) or 1
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9)
    fig.suptitle("parity compare: " + "  vs  ".join(r.path.name for r in runs))
    fig.tight_layout(rect=(0, 0.04 + 0.03 * (len(labels) if wide else 1), 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def compare(run_dirs: Sequence[str | Path], out: str | Path = "compare.png") -> tuple[list[Run], str, object]:
    """Load, label, plot and tabulate; returns (runs, table, figure)."""
    runs = [load_run(Path(p)) for p in run_dirs]
    label_runs(runs)
    fig = plot(runs, Path(out))
    return runs, summary_table(runs), fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parity compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl)")
    parser.add_argument("--out", default="compare.png", help="PNG to write (default compare.png)")
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        runs, table, _ = compare(args.run_dirs, args.out)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table)
    print(f"wrote {args.out} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
