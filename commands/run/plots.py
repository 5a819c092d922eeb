"""The report of one run: PNG plots, eval.json, run_summary.json and summary.md.

Plots: training curves from metrics.jsonl and held-out accuracy from the evaluations, one PNG per
quantity plus `overview.png` with every panel on one page (linked first in summary.md).

Invariants:
- Figures are plain matplotlib `Figure`s (no pyplot, no display), imported lazily so `parity run --help`
  is fast. matplotlib is optional at run time: without it the run draws no PNG, says so on its console
  and in summary.md, and still writes eval.json, run_summary.json and summary.md.
- Every figure's title names the run (its directory) and its seed.
- Mismatch, policy drift and KL(new || old) are drawn on log axes with the running gate's threshold
  on the mismatch and drift panels; a value <= 0 cannot sit on a log axis and is left out (the
  panel says how many), never clipped to a made-up floor.
- The training reward is the mean over the groups the trainer consumed (published groups: with
  `rollout.skip_zero_variance` the flat ones never reach it); its ± std band is clipped to the
  reward's range when the range is known (built-in tasks and rewards lie in [0, 1]).
- Held-out evaluations are points, not lines: two evaluations are two measurements, not a trend.
- A missing metric gives a panel that says so rather than no file, so summary.md links never break.
- x is the trainer's step; `step` in metrics.jsonl is taken as is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from commands.run.console import log
from commands.run.gate import run_threshold
from commands.run.supervisor import format_duration

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from parity.config import ParityConfig


@dataclass(frozen=True)
class Curve:
    title: str
    keys: list[tuple[str, str]]  # (metrics.jsonl key, legend label)
    ylabel: str
    log: bool = False  # log y axis; values <= 0 are left out
    gate: bool = False  # draw the running gate's threshold


CURVES: dict[str, Curve] = {
    "reward": Curve(
        "Training reward (published groups)",
        [("reward_mean", "mean reward, published groups")],
        "reward per completion",
    ),
    "clip_rate": Curve("Clip rate", [("clip_rate", "clip rate")], "fraction of tokens clipped"),
    "kl_new_old": Curve("KL(new || old)", [("kl_new_old", "kl_new_old")], "nats / token", log=True),
    "entropy": Curve("Policy entropy", [("entropy", "entropy")], "nats / token"),
    "mismatch": Curve(
        "Backend mismatch at each token's own version",
        [
            ("mismatch_k3_own_version_informative", "k3, own version, informative tokens (gated)"),
            ("mismatch_k3_own_version", "k3, own version, all clean tokens"),
            ("mismatch_max_abs_own_version", "max |Δ| logprob, own version (not gated)"),
            ("mismatch_k3", "k3, lag-0 clean tokens"),
            ("mismatch_k3_mixed_context", "k3, lag-0 tokens over older KV (mixed context)"),
        ],
        "nats",
        log=True,
        gate=True,
    ),
    "policy_drift": Curve(
        "Policy drift: all tokens vs the current weights",
        [("policy_drift_k3", "k3"), ("policy_drift_max_abs", "max |Δ|")],
        "nats",
        log=True,
        gate=True,
    ),
    "ess": Curve("Effective sample size (normalised)", [("ess", "ESS")], "ESS"),
    "lag": Curve("Rollout staleness", [("lag_mean", "mean lag"), ("lag_max", "max lag")], "versions"),
}
PLOT_NAMES = ["reward", "accuracy", "eval_reward", *[n for n in CURVES if n != "reward"]]
OVERVIEW = "overview"
# eval.json keys drawn on eval_reward.png: held-out mean reward (greedy) and, with task.eval_pass_k,
# pass@k and the samples' mean reward. A value that was not measured (None) gives no point.
EVAL_CURVES = [
    ("reward_mean", "mean reward (greedy)"),
    ("pass_at_k", "pass@k"),
    ("sample_reward_mean", "mean reward (k samples)"),
]
GATE_GID = "gate_threshold"  # the matplotlib gid of the running gate's line (tests find it by it)
# Task sources whose own reward lies in [0, 1] (rollout/tasks), and the built-in rewards (also [0, 1]).
UNIT_REWARD_TASKS = ("arithmetic", "arithmetic_final")
UNIT_REWARD_TASK_PREFIXES = ("jsonl:", "hf:", "reasoning_gym:")
UNIT_REWARDS = ("exact", "last_integer", "math_verify")


@dataclass(frozen=True)
class PlotContext:
    """What the plots say about the run besides its metrics."""

    run_name: str
    seed: int | None = None
    gate_threshold: float | None = None  # the running gate's (trainer.mismatch_gate.running_threshold)
    reward_range: tuple[float, float] | None = None  # None: not known, the band is not clipped
    subtitle: str = ""  # the overview's second title line (model, task, mode, steps)

    @property
    def tag(self) -> str:
        return f"{self.run_name} · seed {self.seed if self.seed is not None else '?'}"

    @classmethod
    def from_config(cls, cfg: ParityConfig, run_dir: Path, steps: int) -> PlotContext:
        try:  # the preflight's k3 sets the threshold under reduced precision
            record = json.loads((run_dir / "config.json").read_text())
        except (OSError, ValueError):
            record = None
        return cls(
            run_name=run_dir.resolve().name,
            seed=cfg.run.seed,
            gate_threshold=run_threshold(cfg, record)[0],
            reward_range=reward_range(cfg.task.name, cfg.task.reward),
            subtitle=f"{cfg.model.name} on {cfg.task.name}, {cfg.run.mode}, {steps} steps",
        )


def reward_range(task_name: str, reward_spec: str) -> tuple[float, float] | None:
    """The range of `task.reward` when every component's is known; None otherwise.

    Built-in tasks' own rewards and the built-in rewards lie in [0, 1]; a weighted sum of them lies in
    [sum of negative weights, sum of positive weights]. Environments, user tasks, user functions and
    remote rewards promise no range.
    """
    lo = hi = 0.0
    for raw in (reward_spec or "task").split(","):
        part = raw.strip()
        if not part:
            continue
        weight_text, star, name = part.partition("*")
        try:
            weight = float(weight_text) if star else 1.0
        except ValueError:
            return None
        name = (name if star else part).strip()
        builtin_task = task_name in UNIT_REWARD_TASKS or task_name.startswith(UNIT_REWARD_TASK_PREFIXES)
        if not (name in UNIT_REWARDS or (name == "task" and builtin_task)) or not math.isfinite(weight):
            return None
        lo, hi = lo + min(0.0, weight), hi + max(0.0, weight)
    return (lo, hi) if hi > lo else None


def _finite(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _curve(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for index, row in enumerate(rows):
        y = _finite(row.get(key))  # null/NaN: nothing was measured that step, so no point
        if y is not None:
            xs.append(float(row.get("step", index)))
            ys.append(y)
    return xs, ys


def log_values(ys: Sequence[float]) -> tuple[list[float], int]:
    """ys for a log axis: values <= 0 become NaN (a gap in the line); also returns how many."""
    out = [y if y > 0 else math.nan for y in ys]
    return out, sum(1 for y in ys if not y > 0)


def note_left_out(ax: Axes, count: int) -> None:
    """Say on the panel how many values a log axis could not show: a legend entry with no marker
    (a note placed on the axes could sit under the legend)."""
    if count:
        ax.plot(
            [],
            [],
            linestyle="none",
            label=f"{count} value{'s' if count > 1 else ''} <= 0 not drawn (log axis)",
        )


def draw_gate(ax: Axes, threshold: float, label: str) -> None:
    ax.axhline(threshold, color="tab:red", linestyle="--", linewidth=1.2, label=label, gid=GATE_GID)


def _eval_points(evals: list[dict], key: str) -> list[tuple[float, float]]:
    return sorted(
        (float(e["step"]), float(e[key]))  # type: ignore[arg-type]
        for e in evals
        if _finite(e.get(key)) is not None and _finite(e.get("step")) is not None
    )


def draw_panel(ax: Axes, name: str, rows: list[dict], evals: list[dict], ctx: PlotContext) -> bool:
    """Draw one quantity on `ax` (title without the run tag); returns whether there was any data."""
    if name == "accuracy":
        points = _eval_points(evals, "accuracy")
        if points:
            ax.plot(
                [x for x, _ in points],
                [100 * y for _, y in points],
                marker="o",
                linestyle="none",
                label="greedy",
            )
            for x, y in points:
                ax.annotate(f"{100 * y:.1f}%", (x, 100 * y), textcoords="offset points", xytext=(0, 6))
        ax.set_title("Held-out accuracy (greedy)")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 105)
        return bool(points)
    if name == "eval_reward":
        drew = False
        k = next((e.get("pass_k") for e in evals if e.get("pass_k")), "k")
        for key, label in EVAL_CURVES:
            points = _eval_points(evals, key)
            if points:
                ax.plot(
                    [x for x, _ in points],
                    [y for _, y in points],
                    marker="o",
                    linestyle="none",
                    label=label.replace("@k", f"@{k}"),
                )
                drew = True
        ax.set_title("Held-out reward and pass@k")
        ax.set_ylabel("reward / fraction of prompts")
        _reward_limits(ax, ctx.reward_range)
        return drew
    curve = CURVES[name]
    drew = False
    left_out = 0
    for key, label in curve.keys:
        xs, ys = _curve(rows, key)
        if not xs:
            continue
        if curve.log:
            ys, skipped = log_values(ys)
            left_out += skipped
            if skipped == len(ys):
                continue
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
        drew = True
    if name == "reward":
        _reward_band(ax, rows, ctx.reward_range)
    if curve.log:
        ax.set_yscale("log")
        note_left_out(ax, left_out)
    if curve.gate and ctx.gate_threshold is not None and ctx.gate_threshold > 0:
        # the gate acts on one curve only (the informative tokens' k3): the label says so, since
        # max |Δ| and drift are drawn on the same axes in nats and may well lie above it
        label = f"running gate = {ctx.gate_threshold:g}"
        draw_gate(
            ax,
            ctx.gate_threshold,
            f"{label} (on informative k3)"
            if name == "mismatch"
            else f"{label} (on the mismatch's k3; drift is not gated)",
        )
    ax.set_title(curve.title)
    ax.set_ylabel(curve.ylabel)
    return drew


def _reward_band(ax: Axes, rows: list[dict], bounds: tuple[float, float] | None) -> None:
    """mean ± std of the published groups' rewards, clipped to the reward's range when known."""
    xs, lo, hi = [], [], []
    for index, row in enumerate(rows):
        mean, std = _finite(row.get("reward_mean")), _finite(row.get("reward_std"))
        if mean is None or std is None:
            continue
        xs.append(float(row.get("step", index)))
        lo.append(mean - std if bounds is None else max(bounds[0], mean - std))
        hi.append(mean + std if bounds is None else min(bounds[1], mean + std))
    if xs:
        label = "± 1 std, published groups" + (
            f" (clipped to [{bounds[0]:g}, {bounds[1]:g}])" if bounds else ""
        )
        ax.fill_between(xs, lo, hi, alpha=0.2, label=label)
    _reward_limits(ax, bounds)


def _reward_limits(ax: Axes, bounds: tuple[float, float] | None) -> None:
    if bounds is not None:
        pad = 0.04 * (bounds[1] - bounds[0])
        ax.set_ylim(bounds[0] - pad, bounds[1] + pad)


def _finish(ax: Axes, drew: bool) -> None:
    if not drew:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=7)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def build_figures(rows: list[dict], evals: list[dict], ctx: PlotContext) -> dict[str, Figure]:
    """The run's figures, by file stem: `overview` (every panel on one page) first, then PLOT_NAMES.

    `evals` are eval.json entries with at least `step` and `accuracy`. The figures are not pyplot's
    (no global state, nothing to close).
    """
    from matplotlib.figure import Figure

    figures = {OVERVIEW: _overview(rows, evals, ctx)}
    for name in PLOT_NAMES:
        fig = Figure(figsize=(6.4, 4.4), dpi=100)
        ax = fig.subplots()
        drew = draw_panel(ax, name, rows, evals, ctx)
        ax.set_title(f"{ax.get_title()}\n{ctx.tag}", fontsize=10)
        _finish(ax, drew)
        fig.tight_layout()
        figures[name] = fig
    return figures


def _overview(rows: list[dict], evals: list[dict], ctx: PlotContext) -> Figure:
    """Every panel on one page; the page title names the run and its seed."""
    from matplotlib.figure import Figure

    ncols = 4
    nrows = math.ceil(len(PLOT_NAMES) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows), dpi=80)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, name in zip(axes.flat, PLOT_NAMES, strict=False):
        _finish(ax, draw_panel(ax, name, rows, evals, ctx))
        ax.title.set_fontsize(10)
    for ax in list(axes.flat)[len(PLOT_NAMES) :]:
        ax.remove()
    fig.suptitle(ctx.tag + (f": {ctx.subtitle}" if ctx.subtitle else ""), fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def plot_run(
    run_dir: Path, rows: list[dict], evals: list[dict], ctx: PlotContext | None = None
) -> list[Path]:
    """Write overview.png and one PNG per quantity into run_dir; return the paths, overview first."""
    figures = build_figures(rows, evals, ctx or PlotContext(run_name=run_dir.resolve().name))
    paths = []
    for name, fig in figures.items():
        path = run_dir / f"{name}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


# --- the report --------------------------------------------------------------------------------------
SUMMARY_KEYS = [
    "reward_mean",
    "clip_rate",
    "kl_new_old",
    "entropy",
    "mismatch_k3_own_version",
    "mismatch_max_abs_own_version",
    "mismatch_k3",
    "mismatch_k3_mixed_context",
    "policy_drift_k3",
    "ess",
    "lag_mean",
    "tokens_per_s",
]


def write_results(
    cfg: ParityConfig, run_dir: Path, rows: list[dict], evals: list[dict], timings: dict, argv: list[str]
) -> None:
    """eval.json, the plots, run_summary.json (for scripts) and summary.md (for people)."""
    by_label = {e["label"]: e for e in evals}
    before, after = by_label.get("before"), by_label.get("after")
    measured = before and after and before["accuracy"] is not None and after["accuracy"] is not None
    delta = after["accuracy"] - before["accuracy"] if measured else None
    _write_json(
        run_dir / "eval.json", {"before": before, "after": after, "accuracy_delta": delta, "evals": evals}
    )
    missing = matplotlib_missing()
    if missing is None:
        plots = plot_run(run_dir, rows, evals, PlotContext.from_config(cfg, run_dir, len(rows)))
    else:
        plots = []
        log(f"plots not drawn: matplotlib is missing ({missing}); eval.json and the summaries are written")
    final = rows[-1] if rows else {}
    summary = {
        "mode": cfg.run.mode, "model": cfg.model.name, "task": cfg.task.name, "steps": len(rows),
        "seed": cfg.run.seed,
        "accuracy_before": before and before["accuracy"], "accuracy_after": after and after["accuracy"],
        "accuracy_delta": delta, "final_metrics": {k: final.get(k) for k in SUMMARY_KEYS}, **timings,
    }  # fmt: skip
    _write_json(run_dir / "run_summary.json", summary)
    lines = [
        f"# parity run: {cfg.model.name} on {cfg.task.name}, {cfg.run.mode}, {len(rows)} steps, "
        f"seed {cfg.run.seed}",
        "",
        f"![overview: every plot of this run on one page]({plots[0].name})"
        if plots
        else f"Plots not drawn: matplotlib is missing ({missing}).",
        "",
        f"- command: `{' '.join(['parity run', *argv])}`",
        f"- wall time: {format_duration(timings['wall_s'])} (startup {format_duration(timings['startup_s'])}, "
        f"training {format_duration(timings['trainer_ready_to_exit_s'])})",
    ]
    if delta is not None:
        lines.append(
            f"- held-out accuracy (greedy, {before['num_prompts']} prompts): "
            f"{100 * before['accuracy']:.1f}% -> {100 * after['accuracy']:.1f}% ({100 * delta:+.1f} points)"
        )
    for e in evals:
        extra = f", pass@{e['pass_k']} {_cell(e.get('pass_at_k'))}" if e.get("pass_k") else ""
        lines.append(
            f"- held-out eval `{e['label']}` at step {e['step']}: accuracy {_cell(e.get('accuracy'))}, "
            f"mean reward {_cell(e.get('reward_mean'))}{extra}, rewards failed {e.get('rewards_failed', 0)}"
        )
    lines += ["", "## Final step", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(final.get(k))} |" for k in SUMMARY_KEYS]
    own = [r.get("mismatch_k3_own_version") for r in rows]
    measured = [v for v in own if _finite(v) is not None]
    if rows:
        lines.append(
            f"| steps with own-version mismatch measured | {len(measured)}/{len(rows)} "
            f"(max k3 {max(measured):.3g}) |"
            if measured
            else f"| steps with own-version mismatch measured | 0/{len(rows)} |"
        )
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots[1:]]
    lines += [
        "",
        "Config: [config.toml](config.toml), [config.json](config.json) · metrics: [metrics.jsonl](metrics.jsonl) · eval: [eval.json](eval.json)",
    ]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")


def matplotlib_missing() -> str | None:
    """Why matplotlib cannot be imported (the ImportError's message), or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a (nothing measured)"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _write_json(path: Path, payload: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
