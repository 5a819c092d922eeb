"""Run trackers (commands/run/trackers.py) with the real packages: TensorBoard event files, W&B offline
run files and an MLflow local file store are read back and compared with metrics.jsonl.

The fast test feeds `RunTrackers` from a metrics.jsonl/samples.jsonl pair laid out as the trainer
writes them (two launches, the second replaying the lineage as a resumed launch does); the slow
resume test (tests/test_resume.py) runs the same read-backs on a real `parity run` with all three.
"""

from __future__ import annotations

import glob
import json
import math
import struct
from pathlib import Path

import pytest

from commands.run.trackers import SAMPLE_COLUMNS, RunTrackers, scalars_of

pytest.importorskip("wandb")  # the `trackers` extra (part of `dev`, installed by scripts/setup.sh)


# --- read-backs (also used by tests/test_resume.py) ------------------------------------------------
def _tensorboard(run_dir: Path):
    """The event files as TensorBoard's UI loads them (the plugin accumulator: purges applied)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard shows it (purged steps removed)."""
    from tensorboard.util import tensor_util

    acc = _tensorboard(run_dir)
    tags = acc.PluginTagToContent("scalars")
    return {
        tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
        for tag in tags
    }


def tensorboard_text_steps(run_dir: Path, tag: str) -> list[int]:
    acc = _tensorboard(run_dir)
    return [e.step for e in acc.Tensors(f"{tag}/text_summary")]


def _wandb_records(path: str) -> list[bytes]:
    """The records of a .wandb file (W&B's LevelDB-style log: 7-byte header, 32 KiB blocks, each
    record a CRC, length and type FULL/FIRST/MIDDLE/LAST)."""
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, out, partial = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        data = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(data)
        elif kind == 2:
            partial = data
        elif kind == 3:
            partial += data
        elif kind == 4:
            out.append(partial + data)
    return out


def wandb_history(run_dir: Path, launch: int) -> dict[int, dict[str, object]]:
    """step -> {key: value} of the offline W&B run of `launch` (RUN_DIR/wandb/offline-run-*-ID)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / f"offline-run-*-*-l{launch}" / "run-*.wandb"))
    history: dict[int, dict[str, object]] = {}
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
        history.setdefault(int(items["_step"]), {}).update(items)
    return history


def mlflow_metrics(run_dir: Path, launch: int) -> tuple[dict[str, dict[int, float]], list[str]]:
    """({key: {step: value}}, table artifact paths) of the MLflow run of `launch`."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{run_dir / 'mlruns'}")
    experiment = client.get_experiment_by_name("parity")
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`parity.launch` = '{launch}'"
    )
    out: dict[str, dict[int, float]] = {}
    for key in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, key)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice {steps}"
        out[key] = {m.step: m.value for m in history}
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "tables")]
    return out, tables


def assert_matches_metrics(run_dir: Path, launch: int) -> None:
    """Every tracker holds every numeric field of every metrics.jsonl row, once, at its step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = {int(r["step"]): scalars_of(r) for r in rows}
    assert expected and all(expected.values())
    steps = sorted(expected)
    tb = tensorboard_scalars(run_dir)
    wb = wandb_history(run_dir, launch)
    ml, tables = mlflow_metrics(run_dir, launch)
    for step, scalars in expected.items():
        for key, value in scalars.items():
            assert tb[key][step] == pytest.approx(value, rel=1e-6), ("tensorboard", key, step)
            assert wb[step][key] == pytest.approx(value, rel=1e-12), ("wandb", key, step)
            assert ml[key][step] == pytest.approx(value, rel=1e-12), ("mlflow", key, step)
    # each metric at exactly the steps that measured it (TensorBoard also holds eval/* at step 0)
    keys = {key for scalars in expected.values() for key in scalars}
    for key in keys:
        measured = [s for s in steps if key in expected[s]]
        assert sorted(tb[key]) == measured, ("tensorboard steps", key, sorted(tb[key]))
        assert sorted(ml[key]) == measured, ("mlflow steps", key)
        assert [s for s in sorted(wb) if key in wb[s]] == measured, ("wandb steps", key)
    assert sorted(tb["reward_mean"]) == steps
    # null (not measured) is absent, never 0
    for row in rows:
        for key, value in row.items():
            if value is None:
                assert row["step"] not in tb.get(key, {}), key
                assert key not in wb.get(row["step"], {}), key
    sampled = sorted(
        {json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()}
    )
    assert sampled == steps
    assert [s for s in sorted(wb) if "samples/_type" in wb[s]] == steps
    assert sorted(t.rsplit("_", 1)[1] for t in tables if "/samples_step_" in t) == [
        f"{s:06d}.json" for s in steps
    ]
    assert tensorboard_text_steps(run_dir, "samples") == steps


# --- the fast test ---------------------------------------------------------------------------------
def _row(step: int, lost: bool = False) -> dict:
    return {
        "step": step,
        "weight_version": step - 1,
        "reward_mean": 0.25 * step + (100.0 if lost else 0.0),
        "loss": -0.5 / step,
        "mismatch_k3": None,  # not measured in this step: must stay absent
        "lag_hist": {"0": 3},
        "dropped_future_version": 0,
    }


def _append(path: Path, records: list[dict]) -> None:
    with open(path, "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))


def _samples(step: int) -> list[dict]:
    return [
        {"step": step, "rollout_id": f"g{step}/0", "prompt": "What is 1 + 1?", "completion": "2",
         "reward": 1.0, "version": step - 1, "lag": 0},
    ]  # fmt: skip


def test_trackers_read_back_equal_metrics_jsonl_across_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics, samples = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
    names = ["tensorboard", "wandb", "mlflow"]
    before = {"label": "before", "step": 0, "accuracy": 0.25, "reward_mean": 0.25,
              "items": [{"prompt_id": "p", "prompt": "q", "answer": "2", "completion": "2", "reward": 1.0,
                         "weight_versions": [0]}]}  # fmt: skip

    # Launch 1 logs steps 1..3, then "dies"; its checkpoint was at step 2.
    first = RunTrackers.open(names, run_dir, 1, {"run": {"steps": 4}})
    first.evaluation(before)
    for step in (1, 2, 3):
        _append(samples, _samples(step))
        _append(metrics, [_row(step, lost=step == 3)])
        first.steps([_row(step, lost=step == 3)])
    first.close(finished=False)
    # The resume cuts the lineage back to step 2; launch 2 replays it, then steps 3..4 are new.
    from commands.run.resume import truncate_lineage

    truncate_lineage(run_dir, 2)
    second = RunTrackers.open(names, run_dir, 2, {"run": {"steps": 4}})
    second.evaluation(before)
    from commands.run.supervisor import MetricsFollower

    second.steps(MetricsFollower(metrics).poll())
    for step in (3, 4):
        _append(samples, _samples(step))
        _append(metrics, [_row(step)])
        second.steps([_row(step)])
    second.close(finished=True)

    assert [r["reward_mean"] for r in map(json.loads, metrics.read_text().splitlines())] == [
        0.25, 0.5, 0.75, 1.0
    ]  # fmt: skip
    assert_matches_metrics(run_dir, launch=2)
    # the lost step 3 (reward 100.75) is only in launch 1's runs; TensorBoard hides it (purge)
    assert tensorboard_scalars(run_dir)["reward_mean"][3] == 0.75
    assert wandb_history(run_dir, 1)[3]["reward_mean"] == 100.75
    assert mlflow_metrics(run_dir, 1)[0]["reward_mean"][3] == 100.75
    assert tensorboard_scalars(run_dir)["eval/accuracy"] == {0: 0.25}
    assert wandb_history(run_dir, 2)[0]["eval/accuracy"] == 0.25
    table = json.loads(
        (run_dir / "wandb")
        .glob("offline-run-*-l2/files/media/table/samples_4_*.table.json")
        .__next__()
        .read_text()
    )
    assert table["columns"] == SAMPLE_COLUMNS and table["data"][0][1] == "g4/0"


def test_nan_and_non_numeric_fields_are_not_logged() -> None:
    assert scalars_of({"step": 1, "a": 1, "b": math.nan, "c": None, "d": [1], "e": True, "f": 2.5}) == {
        "a": 1.0,
        "f": 2.5,
    }


def test_unknown_tracker_names_the_key() -> None:
    from parity.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"^run\.tracker: unknown tracker comet"):
        load(["--tracker", "wandb,comet"], home="run", environ={})
    with pytest.raises(ConfigError, match=r"^run\.tracker: 'none' cannot be combined"):
        load(["--tracker", "none,wandb"], home="run", environ={})
    assert load(["--tracker", "MLflow, tensorboard"], home="run", environ={}).config.run.trackers() == [
        "tensorboard",
        "mlflow",
    ]


def test_a_remote_mlflow_that_never_answers_holds_the_launcher_seconds_not_minutes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracking server that accepts and never answers: MLflow's own defaults (120 s a request,
    7 retries with backoff) held the launcher's monitor loop for about 20 minutes."""
    import os
    import socket
    import time

    from commands.run import trackers
    from commands.run.trackers import MlflowTracker

    assert trackers.MLFLOW_HTTP_DEFAULTS == {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    }  # about 30 s in all against a silent server (measured 34.2 s once)
    quick = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "2",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    }  # the same path, faster
    monkeypatch.setattr(trackers, "MLFLOW_HTTP_DEFAULTS", quick)
    for key in quick:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # the retries only, not their sleeps
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent.getsockname()[1]}")
    start = time.monotonic()
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever MLflow raises after its retries
            MlflowTracker(tmp_path, "silent", 1, {})
    finally:
        silent.close()
    took = time.monotonic() - start
    print(f"gave up after {took:.1f}s")
    assert took < 30 and all(os.environ[k] == v for k, v in quick.items())


def test_an_evaluation_that_scored_nothing_logs_no_accuracy(tmp_path: Path) -> None:
    """Every held-out reward failed: accuracy and reward_mean are None; the trackers get no scalar
    (it raised before, ending the launch) and still the table of what was tried."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = RunTrackers.open(["tensorboard"], tmp_path, 1, {"run": {"steps": 1}})
    nothing = {"label": "before", "step": 0, "accuracy": None, "reward_mean": None,
               "items": [{"prompt_id": "p", "prompt": "q", "answer": "2", "completion": "x", "reward": None,
                          "weight_versions": [0]}]}  # fmt: skip
    trackers.evaluation(nothing)
    trackers.close(finished=True)
    (events,) = [p.parent for p in tmp_path.rglob("events.out.tfevents.*")]
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert not [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("eval/")]
