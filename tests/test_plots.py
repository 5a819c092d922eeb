"""A run's plots read at a glance: log axes with the gate drawn, the reward band inside the reward's
range, held-out accuracy as points, the run and seed in every title, and one overview page linked
first in summary.md. Input: a synthetic run in the metrics.jsonl / eval.json formats."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from commands.run.plots import (
    GATE_GID,
    OVERVIEW,
    PLOT_NAMES,
    PlotContext,
    build_figures,
    draw_panel,
    reward_range,
    write_results,
)
from parity.config import ParityConfig

THRESHOLD = 2e-3
# Five steps: step 3's own-version mismatch is exactly 0 and step 4's was not measured (null);
# step 2's kl_new_old is negative (the k1 estimate can be); rewards are 0/1 with bands past [0, 1].
ROWS = [
    {
        "step": step,
        "reward_mean": mean,
        "reward_std": std,
        "clip_rate": 0.01 * step,
        "kl_new_old": kl,
        "entropy": 1.0 - 0.1 * step,
        "mismatch_k3_own_version": own,
        "mismatch_max_abs_own_version": 1e-4,
        "mismatch_k3": None,
        "policy_drift_k3": 1e-3 * step,
        "policy_drift_max_abs": 1e-2,
        "ess": 0.95,
        "lag_mean": 0.5,
        "lag_max": 1,
    }
    for step, mean, std, kl, own in [
        (1, 0.9, 0.3, 1e-4, 1e-9),
        (2, 0.1, 0.3, -2e-9, 3e-9),
        (3, 0.5, 0.5, 1e-2, 0.0),
        (4, 0.6, 0.49, 5.0, None),
        (5, 0.7, 0.46, 1e-3, 1e-8),
    ]
]
EVALS = [
    {"label": "before", "step": 0, "accuracy": 0.25, "reward_mean": 0.25, "num_prompts": 8},
    {"label": "after", "step": 5, "accuracy": 0.5, "reward_mean": 0.5, "num_prompts": 8},
]
CTX = PlotContext(run_name="seedrun", seed=7, gate_threshold=THRESHOLD, reward_range=(0.0, 1.0))


@pytest.fixture(scope="module")
def figures() -> dict:
    return build_figures(ROWS, EVALS, CTX)


def _ax(figures: dict, name: str):
    (ax,) = figures[name].axes
    return ax


def _line(ax, label: str):
    return next(line for line in ax.get_lines() if line.get_label() == label)


@pytest.mark.parametrize("name", ["mismatch", "policy_drift", "kl_new_old"])
def test_mismatch_drift_and_kl_are_on_log_axes(figures: dict, name: str) -> None:
    assert _ax(figures, name).get_yscale() == "log"
    overview_axes = {ax.get_title(): ax for ax in figures[OVERVIEW].axes}
    title = _ax(figures, name).get_title().split("\n")[0]
    assert overview_axes[title].get_yscale() == "log"


@pytest.mark.parametrize("name", ["mismatch", "policy_drift"])
def test_the_gate_threshold_from_the_config_is_drawn(figures: dict, name: str) -> None:
    (gate,) = [line for line in _ax(figures, name).get_lines() if line.get_gid() == GATE_GID]
    assert list(gate.get_ydata()) == [THRESHOLD, THRESHOLD]
    assert "running gate = 0.002" in gate.get_label()


def test_values_a_log_axis_cannot_show_are_left_out_not_clipped(figures: dict) -> None:
    mismatch = _ax(figures, "mismatch")
    own = _line(mismatch, "k3, own version, all clean tokens")
    # Step 3 (exactly 0) is a gap, step 4 (null) is absent: never a made-up floor value.
    assert list(own.get_xdata()) == [1, 2, 3, 5]
    ys = list(own.get_ydata())
    assert ys[:2] == [1e-9, 3e-9] and math.isnan(ys[2]) and ys[3] == 1e-8
    assert any("1 value <= 0 not drawn" in t.get_text() for t in mismatch.get_legend().get_texts())
    kl = _line(_ax(figures, "kl_new_old"), "kl_new_old")
    assert math.isnan(kl.get_ydata()[1])  # the negative estimate
    assert all(y > 0 for y in kl.get_ydata() if not math.isnan(y))


def test_reward_band_stays_inside_the_reward_range_and_says_published_groups(figures: dict) -> None:
    ax = _ax(figures, "reward")
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    ys = [y for path in band.get_paths() for _, y in path.vertices]
    assert min(ys) == 0.0 and max(ys) == 1.0  # 0.1 - 0.3 and 0.9 + 0.3 are clipped to the range
    assert "published groups" in band.get_label()
    # The axis shows the reward's range (with a small margin), not the band's or the data's extent.
    assert ax.get_ylim() == pytest.approx((-0.04, 1.04))
    assert "published groups" in ax.get_title()


def test_an_unknown_reward_range_leaves_the_band_unclipped() -> None:
    ax = Figure().subplots()
    draw_panel(ax, "reward", ROWS, EVALS, PlotContext("r", 0, THRESHOLD, reward_range=None))
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    ys = [y for path in band.get_paths() for _, y in path.vertices]
    assert min(ys) == pytest.approx(-0.2) and max(ys) == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("task", "reward", "expected"),
    [
        ("arithmetic_final", "", (0.0, 1.0)),
        ("jsonl:data.jsonl", "0.8*math_verify,0.2*exact", (0.0, 1.0)),
        ("hf:gsm8k", "task,-0.5*last_integer", (-0.5, 1.0)),
        ("env:calculator", "", None),  # an environment's episode reward has no promised range
        ("mypkg.tasks:make", "", None),  # a user task
        ("arithmetic", "mypkg.rewards:brevity", None),  # a user function
        ("arithmetic", "grpc:127.0.0.1:50070", None),  # a remote reward
    ],
)
def test_reward_range_is_known_only_for_built_in_rewards(
    task: str, reward: str, expected: tuple[float, float] | None
) -> None:
    assert reward_range(task, reward) == expected


def test_held_out_accuracy_is_drawn_as_points_not_a_line(figures: dict) -> None:
    for name in ("accuracy", "eval_reward"):
        (line,) = _ax(figures, name).get_lines()
        assert line.get_linestyle() == "None" and line.get_marker() == "o", name
        assert list(line.get_xdata()) == [0, 5]
    assert list(_line(_ax(figures, "accuracy"), "greedy").get_ydata()) == [25, 50]


def test_every_title_names_the_run_and_its_seed(figures: dict) -> None:
    assert list(figures) == [OVERVIEW, *PLOT_NAMES]
    for name in PLOT_NAMES:
        title = _ax(figures, name).get_title()
        assert "seedrun" in title and "seed 7" in title, (name, title)
    overview = figures[OVERVIEW]
    assert "seedrun" in overview.get_suptitle() and "seed 7" in overview.get_suptitle()
    assert len(overview.axes) == len(PLOT_NAMES)  # every panel on the one page


def test_write_results_writes_the_overview_and_links_it_first(tmp_path: Path) -> None:
    run_dir = tmp_path / "myrun"
    run_dir.mkdir()
    cfg = ParityConfig(
        model={"name": "tiny"}, run={"seed": 7, "steps": 5}, check={"gate_threshold": THRESHOLD}
    )
    timings = {"wall_s": 60.0, "startup_s": 10.0, "trainer_ready_to_exit_s": 50.0}
    write_results(cfg, run_dir, ROWS, EVALS, timings, ["--model", "tiny"])
    for name in [OVERVIEW, *PLOT_NAMES]:
        assert (run_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (run_dir / "summary.md").read_text()
    images = [line for line in summary.splitlines() if line.startswith("![")]
    assert images[0].endswith("(overview.png)") and len(images) == 1 + len(PLOT_NAMES)
    # Right under the heading, before anything else.
    assert summary.splitlines()[2] == images[0]


def test_the_drawn_gate_threshold_is_the_one_the_trainer_got_from_the_preflight(tmp_path: Path) -> None:
    """bf16 rollouts, no check.gate_threshold: the trainer's threshold comes from the preflight's
    k3 (recorded in config.json); the plots and `parity compare` draw that one, not the default."""
    import json

    from commands.check.compare import Run
    from commands.run.plots import PlotContext
    from tests.conftest import config_for
    from trainer.mismatch_gate import calibrated_threshold, running_threshold

    cfg = config_for("run", model="tiny", **{"rollout.dtype": "bfloat16"})
    k3 = 0.05
    expected = calibrated_threshold(cfg, k3)
    assert expected is not None and expected != running_threshold(cfg)[0]
    record = {
        "config": cfg.model_dump(),
        "preflight": {"ran": True, "report": {"rows": [{"stats": {"k3": k3}}]}},
    }
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert PlotContext.from_config(cfg, tmp_path, 3).gate_threshold == expected
    assert Run(tmp_path, [], record).threshold == expected
