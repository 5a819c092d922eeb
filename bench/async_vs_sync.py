"""Async (PipelineRL-style) vs sync (generate -> train -> update) `parity run`, same budget, one run.

    .venv/bin/python bench/async_vs_sync.py                        # tiny model, quick
    .venv/bin/python bench/async_vs_sync.py --model smollm2-135m   # the real figure (~25 min on 2 cores)

Each mode runs the full pipeline (redis, broadcast, trainer, rollout service) with the same flags
and the same seed. Measured per mode:
- train_s: seconds from the trainer reporting SERVING to its last optimizer step (the time to reach
  the same step count; startup and evaluation are excluded and reported separately);
- final reward: mean training reward over the last quarter of the steps (the same-reward check);
- CPU seconds per component (rollout incl. its vLLM engine core, trainer, broadcast, redis,
  launcher), sampled from /proc every second, and the mean number of busy cores.
The busy-core figure is what says which resource bounds a mode: sync alternates the rollout engine
and the trainer, so it can keep the cores busy only as far as each phase alone can; async overlaps
them, so it is bounded by the cores once the two phases together saturate them.

The final stdout line is a JSON object with both modes and `speedup` = sync train_s / async train_s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

MARKER_ENV = "PARITY_RUN_MARKER"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _role(cmdline: str) -> str:
    for role in ("rollout", "trainer", "broadcast"):
        if f"serve {role}" in cmdline:
            return role
    if "redis-server" in cmdline:
        return "redis"
    return "launcher"


class CpuSampler(threading.Thread):
    """Sums utime+stime (last seen) of every process of the run, by component.

    A process belongs to the run if it carries the run marker in its environment or command line,
    or shares a session with one that does: vLLM's EngineCore and Worker processes write their
    title over their environment (the launcher puts the marker in that title), and stay in their
    rollout service's session either way."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.needle = f"{MARKER_ENV}={marker}".encode()
        self.last_cpu_s: dict[int, tuple[str, float]] = {}
        self.session_roles: dict[int, str] = {}  # session id -> role of its marked leader
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.sample()

    def sample(self) -> None:
        unmarked: list[tuple[int, int, float]] = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                pid, session = int(entry.name), int(fields[3])
                cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
                cmdline = (entry / "cmdline").read_bytes()
                marked = self.needle in cmdline or self.needle in (entry / "environ").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if not marked:
                unmarked.append((pid, session, cpu_s))
                continue
            role = _role(cmdline.replace(b"\0", b" ").decode(errors="replace"))
            if pid == session:
                self.session_roles[session] = role
            self.last_cpu_s[pid] = (self.session_roles.get(session, role), cpu_s)
        for pid, session, cpu_s in unmarked:
            if session in self.session_roles:
                self.last_cpu_s[pid] = (self.session_roles[session], cpu_s)

    def by_role(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for role, cpu_s in self.last_cpu_s.values():
            totals[role] = totals.get(role, 0.0) + cpu_s
        return {role: round(value, 1) for role, value in sorted(totals.items())}


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    out = root / mode
    marker = uuid.uuid4().hex
    flags = [
        "--mode", mode, "--model", args.model, "--steps", str(args.steps), "--seed", str(args.seed),
        "--groups_per_step", str(args.groups_per_step), "--group_size", str(args.group_size),
        "--max_tokens", str(args.max_tokens), "--eval_size", "0", "--skip_preflight", "--out", str(out),
    ]  # fmt: skip
    print(f"[bench] {mode}: parity run {' '.join(flags)}", flush=True)
    sampler = CpuSampler(marker)
    sampler.start()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "commands.main", "run", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, MARKER_ENV: marker},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"[{mode}] {line}", end="", flush=True)
    rc = proc.wait()
    wall_s = time.monotonic() - started
    sampler.done.set()
    sampler.join()
    if rc != 0:
        raise SystemExit(f"[bench] {mode} run failed with exit code {rc}")
    summary = json.loads((out / "run_summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tail = rows[-max(1, len(rows) // 4) :]
    cpu = sampler.by_role()
    train_s = summary["trainer_ready_to_last_step_s"]
    return {
        "mode": mode,
        "steps": len(rows),
        "train_s": round(train_s, 1),
        "wall_s": round(wall_s, 1),
        "startup_s": round(summary["startup_s"], 1),
        "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
        "mean_lag": round(sum(r.get("lag_mean", 0.0) for r in rows) / len(rows), 3),
        "cpu_s": cpu,
        "busy_cores": round(sum(cpu.values()) / wall_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="tiny (quick) or smollm2-135m (the real figure)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups_per_step", type=int, default=8)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="keep the two run directories here")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="parity-bench-"))
    results = {mode: run_mode(mode, args, root) for mode in ("sync", "async")}
    speedup = results["sync"]["train_s"] / max(1e-9, results["async"]["train_s"])
    print(f"[bench] cores: {os.cpu_count()}")
    for mode, result in results.items():
        print(
            f"[bench] {mode:5s}: {result['steps']} steps in {result['train_s']:.1f} s of training "
            f"(wall {result['wall_s']:.1f} s), final reward {result['final_reward']:.3f}, "
            f"mean lag {result['mean_lag']:.2f}, busy cores {result['busy_cores']:.2f}, CPU s {result['cpu_s']}"
        )
    print(f"[bench] async is {speedup:.2f}x the speed of sync to reach {args.steps} steps (goal 1.5x)")
    print(json.dumps({"model": args.model, "cores": os.cpu_count(), "speedup": round(speedup, 3), **results}))


if __name__ == "__main__":
    main()
