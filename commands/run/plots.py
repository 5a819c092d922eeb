"""The report of one run: PNG plots, eval.json, run_summary.json and summary.md.

Plots: training curves from metrics.jsonl and held-out accuracy from the evaluations.

Invariants:
- Uses matplotlib's Agg backend (no display needed), imported lazily so `parity run --help` is fast.
- One PNG per quantity, named `<name>.png` in the run directory; a missing metric gives a plot that
  says so rather than no file, so summary.md links never break.
- x is the trainer's step; `step` in metrics.jsonl is taken as is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from commands.run.supervisor import format_duration

if TYPE_CHECKING:
    from parity.config import ParityConfig

# name -> (title, [(metric key, label)], y label, log scale when all values are positive)
CURVES: dict[str, tuple[str, list[tuple[str, str]], str, bool]] = {
    "reward": ("Training reward", [("reward_mean", "mean reward")], "reward", False),
    "clip_rate": ("Clip rate", [("clip_rate", "clip rate")], "fraction of tokens clipped", False),
    "kl_new_old": ("KL(new || old)", [("kl_new_old", "kl_new_old")], "nats / token", False),
    "entropy": ("Policy entropy", [("entropy", "entropy")], "nats / token", False),
    "mismatch": (
        "Backend mismatch at each token's own version",
        [
            ("mismatch_k3_own_version", "k3, own version (clean tokens)"),
            ("mismatch_max_abs_own_version", "max |Δ|, own version"),
            ("mismatch_k3", "k3, lag-0 clean tokens"),
            ("mismatch_k3_mixed_context", "k3, lag-0 tokens over older KV (mixed context)"),
        ],
        "nats",
        True,
    ),
    "policy_drift": (
        "Policy drift: all tokens vs the current weights",
        [("policy_drift_k3", "k3"), ("policy_drift_max_abs", "max |Δ|")],
        "nats",
        True,
    ),
    "ess": ("Effective sample size (normalised)", [("ess", "ESS")], "ESS", False),
    "lag": ("Rollout staleness", [("lag_mean", "mean lag"), ("lag_max", "max lag")], "versions", False),
}
PLOT_NAMES = ["reward", "accuracy", "eval_reward", *[n for n in CURVES if n != "reward"]]
# eval.json keys drawn on eval_reward.png: held-out mean reward (greedy) and, with task.eval_pass_k,
# pass@k and the samples' mean reward. A value that was not measured (None) gives no point.
EVAL_CURVES = [
    ("reward_mean", "mean reward (greedy)"),
    ("pass_at_k", "pass@k"),
    ("sample_reward_mean", "mean reward (k samples)"),
]


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


def plot_run(run_dir: Path, rows: list[dict], evals: list[dict]) -> list[Path]:
    """Write every plot into run_dir; return the paths in PLOT_NAMES order.

    `evals` are eval.json entries with at least `step` and `accuracy`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name in PLOT_NAMES:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        if name == "accuracy":
            points = sorted(
                (float(e["step"]), float(e["accuracy"]))
                for e in evals
                if _finite(e.get("accuracy")) is not None
            )
            if points:
                ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label="greedy")
                for x, y in points:
                    ax.annotate(f"{100 * y:.1f}%", (x, 100 * y), textcoords="offset points", xytext=(0, 6))
            ax.set_title("Held-out accuracy (greedy)")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(0, 100)
            drew = bool(points)
        elif name == "eval_reward":
            drew = False
            for key, label in EVAL_CURVES:
                points = sorted(
                    (float(e["step"]), float(e[key])) for e in evals if _finite(e.get(key)) is not None
                )
                if points:
                    k = next((e.get("pass_k") for e in evals if e.get("pass_k")), "k")
                    ax.plot(
                        [x for x, _ in points],
                        [y for _, y in points],
                        marker="o",
                        label=label.replace("@k", f"@{k}"),
                    )
                    drew = True
            ax.set_title("Held-out reward and pass@k")
            ax.set_ylabel("reward / fraction of prompts")
        else:
            title, keys, ylabel, log_when_positive = CURVES[name]
            drew = False
            all_positive = True
            for key, label in keys:
                xs, ys = _curve(rows, key)
                if xs:
                    ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
                    drew = True
                    all_positive = all_positive and min(ys) > 0
            if name == "reward":
                xs, means = _curve(rows, "reward_mean")
                _, stds = _curve(rows, "reward_std")
                if xs and len(stds) == len(means):
                    lo = [m - s for m, s in zip(means, stds, strict=True)]
                    hi = [m + s for m, s in zip(means, stds, strict=True)]
                    ax.fill_between(xs, lo, hi, alpha=0.2, label="± std")
            if drew and log_when_positive and all_positive:
                ax.set_yscale("log")
            ax.set_title(title)
            ax.set_ylabel(ylabel)
        if not drew:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(loc="best", fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = run_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
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
    plots = plot_run(run_dir, rows, evals)
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
        f"- command: `parity run {' '.join(argv)}`",
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
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    lines += [
        "",
        "Config: [config.toml](config.toml), [config.json](config.json) · metrics: [metrics.jsonl](metrics.jsonl) · eval: [eval.json](eval.json)",
    ]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a (nothing measured)"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _write_json(path: Path, payload: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
