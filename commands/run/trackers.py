"""Experiment trackers for `parity run`: TensorBoard, Weights & Biases, MLflow (`--tracker a,b`).

One interface (`Tracker`: scalars at a step, a table at a step, close) and one feeder (`RunTrackers`)
that the launcher drives from the run directory's own files, so every tracker shows exactly what
metrics.jsonl says, under the same names:
  - per step: every numeric field of the metrics.jsonl row (null/NaN fields are left out: a metric
    that was not measured is absent, never 0);
  - per step: a `samples` table, the few completions the trainer wrote to samples.jsonl (prompt,
    completion, reward, version, lag, rollout_id);
  - per evaluation: `eval/accuracy` and `eval/reward_mean` at the evaluation's step and an
    `eval_<label>` table (prompt, answer, completion, reward, weight versions).
Why the launcher and not the trainer: it is the one process that sees the metrics, the samples and
the evaluations, and a tracker (a network client, a background process) cannot slow or kill training.

Resume: every launch opens a new tracker run and replays the lineage from step 1 (the launcher cut
metrics.jsonl back to the checkpoint first), so each tracker run holds every step once, and the
steps the killed launch logged after its checkpoint stay only in the killed launch's tracker run.
TensorBoard writes to the same directory, each launch opening with a session START at step 0, which
hides the earlier launches' events.

Packages are imported only when chosen (the `trackers` extra installs all three). Where they write:
  tensorboard  RUN_DIR/tensorboard (event files)
  wandb        RUN_DIR/wandb (offline with WANDB_MODE=offline); project $WANDB_PROJECT or "parity",
               run id <run name>-l<launch>, group <run name>
  mlflow       $MLFLOW_TRACKING_URI, else the local file store RUN_DIR/mlruns; experiment
               $MLFLOW_EXPERIMENT_NAME or "parity"; tables are JSON artifacts under tables/
A tracker that fails while logging is reported once and switched off; training goes on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Protocol

log = logging.getLogger("parity.run.trackers")

SAMPLE_COLUMNS = ["step", "rollout_id", "prompt", "completion", "reward", "version", "lag"]
EVAL_COLUMNS = ["prompt_id", "prompt", "answer", "completion", "reward", "weight_versions"]


class TrackerError(RuntimeError):
    """A chosen tracker cannot start; the message names run.tracker and what is missing."""


class Tracker(Protocol):
    name: str

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Scalars at `step` (steps arrive in non-decreasing order)."""

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list]) -> None:
        """A table at `step`."""

    def close(self, finished: bool) -> None:
        """Flush and end the tracker run (finished: the launch completed the run)."""


def scalars_of(row: dict) -> dict[str, float]:
    """The numeric, finite fields of a metrics.jsonl row, `step` left out."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


# --- TensorBoard -----------------------------------------------------------------------------------
class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackerError(_missing("tensorboard", exc)) from None
        # Every launch starts with a session START at step 0; TensorBoard treats a later START as a
        # restart and hides everything an earlier launch logged (the new launch replays the lineage).
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=0)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text(key, markdown_table(columns, rows), global_step=step)

    def close(self, finished: bool) -> None:
        self.writer.close()


def markdown_table(columns: list[str], rows: list[list]) -> str:
    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# --- Weights & Biases ------------------------------------------------------------------------------
class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, launch: int, config: dict) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise TrackerError(_missing("wandb", exc)) from None
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "parity"),
            dir=str(run_dir),
            id=f"{_slug(run_name)}-l{launch}",
            name=f"{run_name} (launch {launch})",
            group=run_name,
            config=config,
            reinit="create_new",
            settings=wandb.Settings(console="off"),  # the launcher's output stays its own
        )

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)
        self.wandb.teardown()  # stop wandb's background service with the run


# --- MLflow ----------------------------------------------------------------------------------------
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, launch: int, config: dict) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{run_dir / 'mlruns'}"
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store for local use behind this switch (a database needs the
            # full mlflow package; the trackers extra installs mlflow-skinny).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        else:
            # A server that stops answering would hold the launcher's monitor loop (its step
            # timeout, a crashed child) through MLflow's defaults: 120 s a request, 7 retries.
            for key, value in MLFLOW_HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackerError(_missing("mlflow", exc)) from None
        self.Metric = Metric
        self.client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "parity")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(
            experiment_id,
            run_name=f"{run_name}-l{launch}",
            tags={"parity.run": run_name, "parity.launch": str(launch)},
        )
        self.run_id = run.info.run_id
        params = [Param(key[:250], str(value)[:6000]) for key, value in _flatten(config).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(key, value, now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list]) -> None:
        self.client.log_dict(
            self.run_id, {"columns": columns, "data": rows}, f"tables/{key}_step_{step:06d}.json"
        )

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")


def _missing(package: str, exc: ImportError) -> str:
    return f"run.tracker: {package} is not installed ({exc}); pip install -e '.[trackers]'"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


# --- the feeder ------------------------------------------------------------------------------------
def _cell(value: object) -> object:
    """A table cell every tracker accepts: scalars as they are, anything else as JSON text."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(value)


class RunTrackers:
    """Fans metrics rows, samples and evaluations out to the chosen trackers (module docstring)."""

    def __init__(self, trackers: list[Tracker], samples_path: Path) -> None:
        from commands.run.supervisor import MetricsFollower

        self.trackers = trackers
        self._samples = MetricsFollower(samples_path)
        self._pending: dict[int, list[list]] = defaultdict(list)

    @classmethod
    def open(cls, names: list[str], run_dir: Path, launch: int, config: dict) -> RunTrackers:
        """Start each chosen tracker (this launch's tracker run); TrackerError if one cannot."""
        trackers: list[Tracker] = []
        try:
            for name in names:
                if name == "tensorboard":
                    trackers.append(TensorBoardTracker(run_dir))
                elif name == "wandb":
                    trackers.append(WandbTracker(run_dir, run_dir.name, launch, config))
                elif name == "mlflow":
                    trackers.append(MlflowTracker(run_dir, run_dir.name, launch, config))
                else:
                    raise TrackerError(f"run.tracker: unknown tracker {name!r}")
        except BaseException:
            for tracker in trackers:
                tracker.close(finished=False)
            raise
        return cls(trackers, run_dir / "samples.jsonl")

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a tracker must not stop training: report it and drop it
                log.warning("tracker %s failed (%s: %r); it is switched off", tracker.name, what, exc)
                self.trackers.remove(tracker)

    def steps(self, rows: list[dict]) -> None:
        """Log metrics rows (in step order) and each step's samples table."""
        if not self.trackers:
            return
        for sample in self._samples.poll():
            self._pending[int(sample["step"])].append([_cell(sample.get(c)) for c in SAMPLE_COLUMNS])
        for row in rows:
            step = int(row["step"])
            scalars = scalars_of(row)
            self._each("scalars", lambda t, s=step, v=scalars: t.log_scalars(s, v))
            samples = self._pending.pop(step, [])
            for old in [s for s in self._pending if s < step]:
                self._pending.pop(old)  # a step with samples but no metrics row cannot happen
            if samples:
                self._each(
                    "samples", lambda t, s=step, r=samples: t.log_table("samples", s, SAMPLE_COLUMNS, r)
                )

    def evaluation(self, result: dict) -> None:
        """Log one held-out evaluation (commands.run.evaluation.EvalResult.as_dict() + step)."""
        if not self.trackers:
            return
        step = int(result["step"])
        # None when nothing was scored (every held-out reward failed): left out, never 0
        scalars = {
            f"eval/{key}": float(result[key])
            for key in ("accuracy", "reward_mean")
            if result.get(key) is not None
        }
        rows = [[_cell(item.get(c)) for c in EVAL_COLUMNS] for item in result.get("items", [])]
        if scalars:
            self._each("eval", lambda t: t.log_scalars(step, scalars))
        if rows:
            self._each("eval", lambda t: t.log_table(f"eval_{result['label']}", step, EVAL_COLUMNS, rows))

    def close(self, finished: bool) -> None:
        self._each("close", lambda t: t.close(finished))
        self.trackers = []
