"""`parity compare`: one series per run per panel, a final/mean table, labels from config differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commands.check.compare import METRICS, compare, main


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
    assert len(fig.axes) == len(METRICS)
    for ax in fig.axes:
        assert len(ax.get_lines()) == 2, ax.get_title()
    reward_ax = next(ax for ax in fig.axes if ax.get_title() == "reward (mean)")
    assert list(reward_ax.get_lines()[0].get_ydata()) == pytest.approx([0.05 * s for s in range(1, 11)])
    assert out.stat().st_size > 20_000  # a real 1500x800 figure, not an empty canvas
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


def test_runs_without_config_or_with_equal_configs_are_labelled_by_directory(tmp_path: Path) -> None:
    a = make_run(tmp_path / "seed0", "processed", 0.05, with_config=False)
    b = make_run(tmp_path / "seed1", "processed", 0.04, with_config=False)
    runs, _, _ = compare([a, b], tmp_path / "c.png")
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
