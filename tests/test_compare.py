"""`parity compare`: one series per run per panel, a final/mean table, labels from the config keys that
really differ (not ports, streams or run directories), a held-out accuracy panel, a legend inside the
figure, and `--out` naming exactly the file written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from commands.check.compare import METRICS, compare, label_runs, load_run, main
from commands.run.plots import GATE_GID


def make_run(
    path: Path, logprobs_mode: str, reward_slope: float, steps: int = 10, with_config: bool = True
) -> Path:
    path.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "weight_version": step,
                "reward_mean": reward_slope * step,
                "clip_rate": 0.01 * step,
                "kl_new_old": 1e-3 * step,
                "entropy": 2.0 - 0.1 * step,
                "mismatch_k3": 1e-10 if logprobs_mode == "processed" else 0.1,
                "lag_mean": 0.5,
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_config:
        config = {
            "run": {
                "model": "tiny",
                "steps": steps,
                "logprobs_mode": logprobs_mode,
                "out": str(path),
                "seed": 0,
            },
            "marker": path.name,
        }
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_two_runs_give_one_series_each_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_run(tmp_path / "good", "processed", 0.05)
    broken = make_run(tmp_path / "broken", "raw", 0.02)
    out = tmp_path / "cmp.png"
    runs, table, fig = compare([good, broken], out)
    # Only the setting that differs labels the runs (out/marker differ too but are ignored).
    assert [r.label for r in runs] == ["logprobs_mode=processed", "logprobs_mode=raw"]
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert len(panels) == len(METRICS) + 1  # the metrics and held-out accuracy; the legend has no title
    for title, _, _, _ in METRICS:
        runs_drawn = [
            line for line in panels[title].get_lines() if line.get_label() in {r.label for r in runs}
        ]
        assert len(runs_drawn) == 2, title
    reward_ax = panels["training reward (mean, published groups)"]
    assert list(reward_ax.get_lines()[0].get_ydata()) == pytest.approx([0.05 * s for s in range(1, 11)])
    assert out.stat().st_size > 20_000  # a real figure, not an empty canvas
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Table: final and mean reward of each run.
    reward_lines = [line for line in table.splitlines() if line.startswith("reward_mean")]
    assert len(reward_lines) == 2
    assert reward_lines[0].split()[-2:] == ["0.5", "0.275"]
    assert reward_lines[1].split()[-2:] == ["0.2", "0.11"]

    assert main([str(good), str(broken), "--out", str(tmp_path / "cli.png")]) == 0
    printed = capsys.readouterr().out
    assert "logprobs_mode=raw" in printed and "mismatch_k3" in printed
    assert (tmp_path / "cli.png").stat().st_size > 20_000


def _launched_run(path: Path, seed: int, port: int, accuracy: tuple[float, float]) -> Path:
    """A run directory as `parity run` leaves it: config.json's resolved "config" beside per-launch
    records (addresses, marker, stream), and eval.json with before/after evaluations."""
    make_run(path, "processed", 0.05 + 0.01 * seed, with_config=False)
    address = f"127.0.0.1:{port}"
    config = {
        "model": {"name": "tiny"},
        "run": {
            "seed": seed,
            "steps": 10,
            "out": f"runs/{path.name}",
            "redis_url": f"redis://:***@127.0.0.1:{port + 1}/0",
            "stream": f"parity:rollouts:{port:016x}",
            "startup_timeout_s": 600.0,
        },
        "rollout": {"broadcast_address": address, "port": 0, "worker_id": "", "logprobs_mode": "processed"},
        "trainer": {"broadcast_address": address, "run_dir": str(path.resolve()), "lr": 3e-5},
        "check": {"threshold": 1e-3, "gate_threshold": 1e-4, "rollout_address": ""},
    }
    record = {
        "argv": ["--seed", str(seed), "--out", f"runs/{path.name}"],
        "run_dir": str(path.resolve()),
        "marker": f"{port:032x}",
        "stream": config["run"]["stream"],
        "config_file": str(path / "config.toml"),
        "config": config,
        "broadcast": {"address": address},
        "rollout_services": {"rollout0": {"address": f"127.0.0.1:{port + 2}"}},
    }
    (path / "config.json").write_text(json.dumps(record))
    evals = [
        {"label": "before", "step": 0, "accuracy": accuracy[0]},
        {"label": "after", "step": 10, "accuracy": accuracy[1]},
    ]
    (path / "eval.json").write_text(json.dumps({"before": evals[0], "after": evals[1], "evals": evals}))
    return path


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, str, object]:
    root = tmp_path_factory.mktemp("two_seeds")
    a = _launched_run(root / "seed0", 0, 41001, (0.25, 0.5))
    b = _launched_run(root / "seed1", 1, 52002, (0.25, 0.625))
    return compare([a, b], root / "c.png")


def test_runs_of_a_real_launch_are_labelled_by_the_seed_not_ports_and_streams(two_seeds: tuple) -> None:
    runs, _, fig = two_seeds
    assert [r.label for r in runs] == ["seed=0", "seed=1"]
    assert "seed0 (seed 0)" in fig.get_suptitle() and "seed1 (seed 1)" in fig.get_suptitle()


def test_a_method_key_that_differs_is_labelled_with_the_seed(tmp_path: Path) -> None:
    a = _launched_run(tmp_path / "a", 0, 41001, (0.25, 0.5))
    b = _launched_run(tmp_path / "b", 1, 52002, (0.25, 0.5))
    record = json.loads((b / "config.json").read_text())
    record["config"]["trainer"]["lr"] = 1e-5
    (b / "config.json").write_text(json.dumps(record))
    runs = [load_run(a), load_run(b)]
    label_runs(runs)
    assert [r.label for r in runs] == ["seed=0, lr=3e-05", "seed=1, lr=1e-05"]


def test_held_out_accuracy_panel_draws_each_runs_evaluations_as_points(two_seeds: tuple) -> None:
    _, table, fig = two_seeds
    (accuracy,) = [ax for ax in fig.axes if ax.get_title().startswith("held-out accuracy")]
    lines = accuracy.get_lines()
    assert [line.get_label() for line in lines] == ["seed=0", "seed=1"]
    for line in lines:
        assert line.get_linestyle() == "None" and line.get_marker() == "o"
        assert list(line.get_xdata()) == [0, 10]
    assert list(lines[1].get_ydata()) == [25, 62.5]
    final = [line.split()[-2] for line in table.splitlines() if line.startswith("heldout_accuracy")]
    assert final == ["50", "62.5"]


def test_log_axes_and_the_gate_on_the_mismatch_panel(two_seeds: tuple) -> None:
    _, _, fig = two_seeds
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert panels["kl_new_old (nats / token)"].get_yscale() == "log"
    mismatch = panels["mismatch k3 (nats)"]
    assert mismatch.get_yscale() == "log"
    (gate,) = [line for line in mismatch.get_lines() if line.get_gid() == GATE_GID]
    assert list(gate.get_ydata()) == [1e-4, 1e-4]  # the running gate's, not the preflight's 1e-3


def test_legend_sits_inside_the_figure_even_with_long_labels(tmp_path: Path) -> None:
    runs_dirs = []
    for index in range(3):
        path = _launched_run(tmp_path / f"r{index}", index, 41001 + 10 * index, (0.25, 0.5))
        record = json.loads((path / "config.json").read_text())
        record["config"]["trainer"].update(
            lr=1e-5 * (index + 1),
            is_correction=f"mode_{index}_with_a_long_name",
            objective=f"objective{index}",
        )
        (path / "config.json").write_text(json.dumps(record))
        runs_dirs.append(path)
    runs, _, fig = compare(runs_dirs, tmp_path / "c.png")
    assert all(len(r.label) > 40 for r in runs)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lay the figure out as savefig does
    renderer = canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1
    box = legends[0].get_window_extent(renderer)
    figure_box = fig.bbox
    assert box.x0 >= figure_box.x0 and box.y0 >= figure_box.y0
    assert box.x1 <= figure_box.x1 and box.y1 <= figure_box.y1
    shown = " ".join(text.get_text().replace("\n", " ") for text in legends[0].get_texts())
    for run in runs:
        assert run.label in shown


def test_out_directory_writes_compare_png_inside_and_prints_that_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_run(tmp_path / "a", "processed", 0.05)
    b = make_run(tmp_path / "b", "raw", 0.02)
    out_dir = tmp_path / "reports"
    assert main([str(a), str(b), "--out", str(out_dir)]) == 0
    assert (out_dir / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "reports.png").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out_dir / 'compare.png'} (2 runs)"
    # A file name: written as given, and said so.
    assert main([str(a), str(b), "--out", str(tmp_path / "x.svg")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'x.svg'} (2 runs)"
    assert (tmp_path / "x.svg").read_bytes().lstrip().startswith(b"<?xml")
    # Neither a figure nor a directory: refused, nothing created.
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out in (tmp_path / "x.jpg", notes):
        assert main([str(a), str(b), "--out", str(out)]) == 2
        assert "--out: " in capsys.readouterr().err
    assert not (tmp_path / "x.jpg").exists() and notes.read_text() == "mine"


def test_runs_without_config_or_with_equal_configs_are_labelled_by_directory(tmp_path: Path) -> None:
    a = make_run(tmp_path / "seed0", "processed", 0.05, with_config=False)
    b = make_run(tmp_path / "seed1", "processed", 0.04, with_config=False)
    runs = [load_run(a), load_run(b)]
    label_runs(runs)
    assert [r.label for r in runs] == ["seed0", "seed1"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such run directory"),
        ("no_metrics", "no metrics.jsonl"),
        ("empty_metrics", "empty"),
        ("bad_line", "not JSON"),
    ],
)
def test_bad_run_dirs_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    good = make_run(tmp_path / "good", "processed", 0.05)
    bad = tmp_path / case
    if case != "missing":
        bad.mkdir()
    if case == "empty_metrics":
        (bad / "metrics.jsonl").write_text("\n")
    if case == "bad_line":
        (bad / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,\n')
    assert main([str(good), str(bad), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err
    assert not (tmp_path / "x.png").exists()


def test_no_run_dir_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "RUN_DIR" in capsys.readouterr().err
