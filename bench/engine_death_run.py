"""A `parity run` that loses its rollout engine: SIGKILL vLLM's engine core mid-run, check the run ends.

    .venv/bin/python bench/engine_death_run.py OUT_DIR [--steps 8] [--kill_after_step 2]

Starts `parity run --skip_preflight --model tiny --steps N --groups_per_step 2 --group_size 4
--max_tokens 32 --eval_size 0 --max_model_len 256 --out OUT_DIR` (its own private Redis), and once
metrics.jsonl holds `kill_after_step` rows sends SIGKILL to the process whose command line holds
`EngineCore` among the launcher's descendants (vLLM V1 runs its engine core in a child process of
the rollout service). A fault check, not a speed benchmark (issue #20). Final stdout line, JSON: the
launcher's exit code, steps done, wall seconds, each rollout service's `engine_restarts_total` from
config.json, the steps' weight versions, and `vllm_left_behind`: the vLLM processes (engine cores and
workers, of the first engine and of the restarted one, as seen among the launcher's descendants
every 0.5 s) still alive 15 s after the launcher exited (must be empty).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="run directory (must not hold a run)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill_after_step", type=int, default=2)
    args = parser.parse_args()
    import psutil

    flags = ["--skip_preflight", "--model", "tiny", "--steps", str(args.steps), "--groups_per_step", "2",
             "--group_size", "4", "--max_tokens", "32", "--eval_size", "0", "--out", str(args.out),
             "--max_model_len", "256", "--startup_timeout_s", "300"]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.parent / f"{args.out.name}.launcher.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "commands.main", "run", *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=ROOT,
        )
    metrics = args.out / "metrics.jsonl"
    killed_after = None
    seen: dict[int, psutil.Process] = {}  # every vLLM process of the run (pid and start time)
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if child.name().startswith("VLLM") and "::" in child.name():  # VLLM[marker]::EngineCore
                        seen.setdefault(child.pid, child)
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if killed_after is None and len(rows) >= args.kill_after_step:
            cores = [
                p
                for p in psutil.Process(proc.pid).children(recursive=True)
                if "EngineCore" in " ".join(p.cmdline())
            ]
            cores[0].send_signal(signal.SIGKILL)
            killed_after = len(rows)
            print(f"killed engine core {cores[0].pid} after step {killed_after}", flush=True)
        time.sleep(0.5)
    left_behind = alive(list(seen.values()), timeout_s=15)
    for leftover in seen.values():  # do not leave them to the machine
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    record = json.loads((args.out / "config.json").read_text()) if (args.out / "config.json").exists() else {}
    final = record.get("final_rollout_status", {})
    print(
        json.dumps(
            {
                "rc": proc.returncode,
                "steps": len(rows),
                "killed_after_step": killed_after,
                "wall_s": round(time.monotonic() - started),
                "engine_restarts_total": {
                    name: status.get("engine_restarts_total") for name, status in final.items()
                },
                "weight_versions": [row["weight_version"] for row in rows],
                "vllm_processes_seen": len(seen),
                "vllm_left_behind": left_behind,
                "launcher_log": str(log_path),
            }
        )
    )
    return 0 if proc.returncode == 0 and not left_behind else 1


def alive(procs: list, timeout_s: float) -> list[str]:
    """`name pid (ppid P)` of those of `procs` still alive after up to `timeout_s` (zombies are gone)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.name()} {p.pid} (ppid {p.ppid()})")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
