"""`parity compare RUN_DIR [RUN_DIR ...]`: overlay the runs' training curves, print final/mean values.

    parity compare runs/seed0 runs/seed1 --out compare.png     # writes compare.png
    parity compare runs/seed0 runs/seed1 --out reports/        # writes reports/compare.png

Reads each run directory's `metrics.jsonl` (one JSON object per trainer step; required),
`config.json` (the resolved configuration `parity run` writes; optional) and `eval.json` (the
held-out evaluations; optional). Draws one panel per metric the source post plotted (clip rate,
kl_new_old, entropy, reward) plus the lag-0 mismatch (k3), the staleness (mean lag) and the held-out
accuracy, one series per run, x = trainer step; the legend has a panel of its own.

Labels: each run is labelled by the configuration keys whose values differ between the runs, leaving
out the keys that differ on every launch and say nothing about the method (ports, addresses, stream
ids, run directories, timestamps; `PER_LAUNCH_KEYS`). Runs whose configs agree, or have none, are
labelled by directory name.

Invariants: a missing directory, a directory without a non-empty metrics.jsonl, or a malformed line
is an error that names the file (exit 2), never a silently empty curve. A metric a run does not
log is left out of that run's panel and shown as "-" in the table. Log axes leave values <= 0 out
(and say how many) rather than clipping them. The command prints the path of the file it wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from commands.run.plots import draw_gate, log_values, note_left_out

# Panels: (title, [(metrics.jsonl key, line style, what the style means)], log-scale y, draw the
# running gate's threshold). A panel with two keys draws each run in its colour, one style per key.
METRICS = (
    ("clip rate", [("clip_rate", "-", "")], False, False),
    ("kl_new_old (nats / token)", [("kl_new_old", "-", "")], True, False),
    ("entropy (nats / token)", [("entropy", "-", "")], False, False),
    ("training reward (mean, published groups)", [("reward_mean", "-", "")], False, False),
    (
        "mismatch k3 (nats)",
        [
            ("mismatch_k3_own_version_informative", "-", "own version, informative tokens (gated)"),
            ("mismatch_k3_own_version", ":", "own version, all tokens"),
            ("mismatch_k3", "--", "lag-0 clean tokens"),
        ],
        True,
        True,
    ),
    ("lag (mean, versions)", [("lag_mean", "-", "")], False, False),
)
METRIC_KEYS = [key for _, keys, _, _ in METRICS for key, _, _ in keys]
ACCURACY_TITLE = "held-out accuracy (greedy, %)"
DEFAULT_NAME = "compare.png"
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
# Keys that differ between any two launches and say nothing about the method: where the services
# listened, which stream and directory the launch used, when it ran, how long the launcher waits.
PER_LAUNCH_KEYS = frozenset(
    {
        "argv",
        "out",
        "run_dir",
        "config_file",
        "marker",
        "stream",
        "redis_url",
        "resume",
        "resume_override",
        "host",
        "data_host",
        "port",
        "port_file",
        "store_port",
        "metrics_port",
        "worker_id",
        "worker_index",
        "consumer_name",
        "rollout_address",
        "broadcast_address",
        "otlp_endpoint",
        "traces_exporter",
        "log_level",
        "tracker",
        "startup_timeout_s",
        "step_timeout_s",
        "progress_interval_s",
        "i_know_the_mismatch_is_high",
        "skip_preflight",
    }
)
PER_LAUNCH_SUFFIXES = ("_address", "_port", "_url", "_file", "_at", "_time", "timestamp")
MAX_LABEL_KEYS = 6


class CompareError(ValueError):
    """Bad input; the message names the run directory or file."""


@dataclass
class Run:
    path: Path
    rows: list[dict]
    config: dict
    evals: list[dict] = field(default_factory=list)
    label: str = ""

    @property
    def settings(self) -> dict:
        """The resolved configuration: config.json's "config" section as `parity run` writes it."""
        for section in ("config", "run"):
            if isinstance(self.config.get(section), dict):
                return self.config[section]
        return self.config

    @property
    def seed(self) -> object:
        settings = self.settings
        run = settings.get("run") if isinstance(settings.get("run"), dict) else settings
        return run.get("seed")

    @property
    def threshold(self) -> float | None:
        """The running gate's threshold of the run's config (None when the config cannot say)."""
        from commands.run.gate import run_threshold
        from parity.config import ParityConfig

        try:
            return run_threshold(ParityConfig.model_validate(self.settings), self.config)[0]
        except Exception:  # an older or partial config: no gate line rather than a wrong one
            return None

    def series(self, key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for i, row in enumerate(self.rows):
            value = row.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                xs.append(float(row.get("step", i + 1)))
                ys.append(float(value))
        return xs, ys

    def accuracy(self) -> tuple[list[float], list[float]]:
        """Held-out accuracy (%) at each evaluation's step."""
        points = sorted(
            (float(e["step"]), 100 * float(e["accuracy"]))
            for e in self.evals
            if isinstance(e.get("step"), int | float)
            and isinstance(e.get("accuracy"), int | float)
            and math.isfinite(e["accuracy"])
        )
        return [x for x, _ in points], [y for _, y in points]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CompareError(f"{path}: not JSON ({exc.msg})") from None


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
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    evals: list[dict] = []
    if (path / "eval.json").is_file():
        report = _read_json(path / "eval.json")
        found = report.get("evals") if isinstance(report, dict) else None
        if not isinstance(found, list):  # an older eval.json: only before and after
            found = [report.get(k) for k in ("before", "after")] if isinstance(report, dict) else []
        evals = [e for e in found if isinstance(e, dict)]
    return Run(path, rows, config if isinstance(config, dict) else {}, evals)


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(value) if isinstance(value, list) else value}


def is_per_launch(key: str) -> bool:
    """Whether a (dotted) config key differs on every launch whatever the method."""
    leaf = key.split(".")[-1]
    return leaf in PER_LAUNCH_KEYS or leaf.endswith(PER_LAUNCH_SUFFIXES)


def differing_keys(runs: Sequence[Run]) -> list[str]:
    """The config keys (dotted) whose values differ between the runs, per-launch keys left out."""
    flat = [_flatten(r.settings) for r in runs]
    keys = sorted({k for f in flat for k in f if not is_per_launch(k)})
    return [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat}) > 1]


def _short_names(keys: Sequence[str]) -> dict[str, str]:
    """A key's last part when no other differing key ends in it (`seed`), else the dotted key."""
    leaves = [k.split(".")[-1] for k in keys]
    return {k: leaf if leaves.count(leaf) == 1 else k for k, leaf in zip(keys, leaves, strict=True)}


def label_runs(runs: Sequence[Run]) -> None:
    """Set each run's label to the settings where the runs differ (`key=value, ...`)."""
    differing = differing_keys(runs)
    short = _short_names(differing)
    flat = [_flatten(r.settings) for r in runs]
    names = [r.path.name or str(r.path) for r in runs]
    for run, f, name in zip(runs, flat, names, strict=True):
        if not differing or not run.config:
            run.label = name
            continue
        parts = [f"{short[k]}={f.get(k, '-')}" for k in differing[:MAX_LABEL_KEYS]]
        if len(differing) > MAX_LABEL_KEYS:
            parts.append(f"+{len(differing) - MAX_LABEL_KEYS} more")
        run.label = ", ".join(parts)
    if len(set(r.label for r in runs)) < len(runs):  # equal settings: add the directory
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
    """One block per metric: final and mean value for each run (held-out accuracy: per evaluation)."""
    header = ["metric", "run", "steps", "final", "mean"]
    cells = [header]
    blocks = [(key, lambda run, key=key: run.series(key)) for key in METRIC_KEYS]
    blocks.append(("heldout_accuracy_%", lambda run: run.accuracy()))
    for key, series in blocks:
        for run in runs:
            _, ys = series(run)
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


def output_path(out: str | Path) -> Path:
    """`--out`: a path ending in .png/.svg/.pdf is the file; anything else is a directory for compare.png."""
    path = Path(out)
    if path.is_dir():
        return path / DEFAULT_NAME
    if path.suffix.lower() in FIGURE_SUFFIXES:
        return path
    if path.suffix or path.exists():  # x.jpg would become a directory x.jpg/ holding compare.png
        raise CompareError(
            f"--out: {out}: a figure ends in {', '.join(sorted(FIGURE_SUFFIXES))}; anything else names "
            "a directory, and this is a file or looks like one"
        )
    return path / DEFAULT_NAME


def _title(runs: Sequence[Run]) -> str:
    def one(run: Run) -> str:
        return f"{run.path.name} (seed {run.seed})" if run.seed is not None else run.path.name

    return "parity compare: " + "  vs  ".join(one(r) for r in runs)


def plot(runs: Sequence[Run], out: Path):  # -> matplotlib Figure (imported lazily)
    """The overlay figure (2 x 4 panels: six metrics, held-out accuracy, the legend); returns the Figure."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(20, 8.5))
    axes = fig.subplots(2, 4)
    panels = list(axes.flat)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    thresholds = sorted({t for t in (r.threshold for r in runs) if t is not None})
    for ax, (title, keys, log_y, gate) in zip(panels, METRICS, strict=False):
        left_out = 0
        for key, style, meaning in keys:
            drew = False
            for run, color in zip(runs, colors, strict=True):
                xs, ys = run.series(key)
                if log_y:
                    ys, skipped = log_values(ys)
                    left_out += skipped
                if xs and any(math.isfinite(y) for y in ys):
                    marker = "." if len(ys) < 30 else None
                    ax.plot(xs, ys, linestyle=style, marker=marker, color=color, label=run.label, gid=key)
                    drew = True
            if drew and meaning:
                ax.plot([], [], linestyle=style, color="0.3", label=f"mismatch: {meaning}")
        if log_y:
            ax.set_yscale("log")
            note_left_out(ax, left_out)
        if gate:
            for threshold in thresholds:
                draw_gate(ax, threshold, f"running gate = {threshold:g}")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    accuracy_ax = panels[len(METRICS)]
    for run, color in zip(runs, colors, strict=True):
        xs, ys = run.accuracy()
        if xs:
            accuracy_ax.plot(xs, ys, marker="o", linestyle="none", color=color, label=run.label)
    if not accuracy_ax.get_lines():
        accuracy_ax.text(0.5, 0.5, "no eval.json", ha="center", va="center", transform=accuracy_ax.transAxes)
    accuracy_ax.set_title(ACCURACY_TITLE)
    accuracy_ax.set_ylim(0, 100)
    accuracy_ax.grid(alpha=0.3)
    for ax in panels[: len(METRICS) + 1]:
        ax.set_xlabel("trainer step")
    # The legend, in a panel of its own inside the figure: one colour per run, then what the line
    # styles and the dashed red line mean.
    legend_ax = panels[-1]
    legend_ax.axis("off")
    entries: dict[str, object] = {
        run.label: Line2D([], [], color=color, marker="o") for run, color in zip(runs, colors, strict=True)
    }
    for ax in panels[:-1]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    legend_ax.legend(
        list(entries.values()), [_wrap(label) for label in entries], loc="center", fontsize=9, frameon=False
    )
    fig.suptitle(_title(runs))
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig


def _wrap(label: str, width: int = 48) -> str:
    """Break a long label at its commas so that it fits the legend panel."""
    lines, current = [], ""
    for part in label.split(", "):
        candidate = f"{current}, {part}" if current else part
        if current and len(candidate) > width:
            lines.append(current + ",")
            current = part
        else:
            current = candidate
    return "\n".join([*lines, current])


def compare(run_dirs: Sequence[str | Path], out: str | Path = DEFAULT_NAME) -> tuple[list[Run], str, object]:
    """Load, label, plot (into `output_path(out)`) and tabulate; returns (runs, table, figure)."""
    runs = [load_run(Path(p)) for p in run_dirs]
    label_runs(runs)
    fig = plot(runs, output_path(out))
    return runs, summary_table(runs), fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parity compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl)")
    parser.add_argument(
        "--out",
        default=DEFAULT_NAME,
        help=f"the figure to write (.png, .svg or .pdf), or a directory to write {DEFAULT_NAME} into "
        f"(default {DEFAULT_NAME})",
    )
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        runs, table, _ = compare(args.run_dirs, args.out)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the figure could not be written there
        print(f"error: --out: {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(table)
    print(f"wrote {output_path(args.out)} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
