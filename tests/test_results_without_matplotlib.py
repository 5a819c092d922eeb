"""`parity run`'s results on a host without matplotlib (commands/run/plots.py, write_results).

A GPU host may lack matplotlib. The run has trained by the time it writes its results, so a missing
plotting library must not cost it the rest: eval.json, run_summary.json and summary.md are written, no
PNG is, and the console and summary.md say why the plots are absent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from commands.run.plots import write_results
from parity.config import ParityConfig

ROWS = [
    {"step": 1, "reward_mean": 0.25, "reward_std": 0.1, "mismatch_k3_own_version": 3.5e-6},
    {"step": 2, "reward_mean": 0.5, "reward_std": 0.2, "mismatch_k3_own_version": 4.5e-6},
]
EVALS = [
    {"label": "before", "step": 0, "accuracy": 0.25, "num_prompts": 8, "reward_mean": 0.25},
    {"label": "after", "step": 2, "accuracy": 0.5, "num_prompts": 8, "reward_mean": 0.5},
]
TIMINGS = {"wall_s": 16.0, "startup_s": 6.0, "trainer_ready_to_exit_s": 10.0}


def test_without_matplotlib_the_results_are_written_and_the_missing_plots_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)  # an earlier test's import must not be reused
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(ImportError):
        import matplotlib.figure  # noqa: F401
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = ParityConfig(model={"name": "tiny"}, run={"seed": 3, "steps": 2})

    write_results(cfg, run_dir, ROWS, EVALS, TIMINGS, ["--model", "tiny"])

    assert list(run_dir.glob("*.png")) == []
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["accuracy_delta"] == pytest.approx(0.25)
    assert json.loads((run_dir / "eval.json").read_text())["after"]["accuracy"] == 0.5
    text = (run_dir / "summary.md").read_text()
    assert ".png" not in text and "## Plots" not in text
    assert "Plots not drawn: matplotlib is missing" in text.splitlines()[2]  # where the overview would be
    assert "| reward_mean | 0.5 |" in text
    logged = [line for line in capsys.readouterr().out.splitlines() if "plots not drawn" in line]
    assert len(logged) == 1 and "matplotlib is missing" in logged[0], logged
