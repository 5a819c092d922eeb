"""Every fault class injected into a live `parity run`, one run per class, and what caught it.

    python -m bench.faults_live [--faults a,b] [--steps 6] [--inject_version 2] [--out DIR]

Each run is tests/test_faults_live.py's: the tiny model, sync mode, the reference engine, the fault
from weight version `--inject_version` (`rollout.fault`), with the fault check's sampling and
learning rate and a meaningless reward that varies between completions (`varied_reward`: the tiny
model earns 0 on every real task, and weights that never move hide every class that serves or tags
the wrong version). one_worker_not_updated runs with two rollout workers (it acts on the second);
the multi-turn classes run `VariedTurns` (two model turns), episode_version_tag in async mode (it
shows only when an update lands between two turns). Runs go one at a time. Per class: the first
step that trains a faulty token (sync: the step that trains `--inject_version`; episode_version_tag:
the first step whose trained_rollouts.jsonl holds a rollout the actor logged as changed), the step
the run stopped at (the last step in metrics.jsonl; the launcher exits non-zero when the running
gate stops it), the gate's signal at that step (mismatch_k3_own_version_informative), and the top 3
candidates of the run dir's mismatch report. Writes faults_live.json and faults_live.md into --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from commands.run.supervisor import MARKER_ENV
from parity.faults import FAULTS, MULTI_TURN_FAULTS
from rollout.episodes import FAULTY_ROLLOUTS_LOG
from trainer.mismatch_locate import MISMATCH_REPORT

SIGNAL = "mismatch_k3_own_version_informative"


def run_flags(name: str, out: Path, steps: int, inject_version: int) -> list[str]:
    flags = ["--skip_preflight", "--model", "tiny", "--mode", "sync", "--steps", str(steps),
        "--groups_per_step", "2", "--group_size", "4", "--max_tokens", "8", "--eval_size", "0",
        "--max_model_len", "256", "--startup_timeout_s", "300", "--out", str(out),
        "--rollout.engine", "reference", "--rollout.enable_fault_injection", "true",
        "--rollout.fault", f"{name}@{inject_version}",
        # The fault check's sampling and learning rate (commands/check/faults.py): with top-k and
        # top-p off, their replay faults change nothing, and the weights must move between versions
        # for a fault that serves or tags the wrong version to change any logprob.
        "--temperature", "0.8", "--top_k", "40", "--top_p", "0.95", "--lr", "1e-3",
    ]  # fmt: skip
    if name not in MULTI_TURN_FAULTS:
        flags += ["--reward", "bench.faults_live:varied_reward"]
    if name == "one_worker_not_updated":
        flags += ["--rollout_workers", "2"]
    if name in MULTI_TURN_FAULTS:
        flags += ["--task", "env:bench.faults_live:VariedTurns", "--max_turns", "2"]
        for key, value in (("--max_model_len", "512"), ("--groups_per_step", "4"), ("--max_tokens", "32")):
            flags[flags.index(key) + 1] = value
    if name == "episode_version_tag":
        # Async, longer turns and a deeper backlog: the actor must be mid-episode when an update lands.
        flags[flags.index("--mode") + 1] = "async"
        flags[flags.index("--max_tokens") + 1] = "128"
        flags += ["--max_lag", "4"]
        # Its changed turns are stale tokens in some groups only: rescore the stale tokens of every
        # group (the default rescores one group a step, which may not hold a changed turn).
        flags += ["--trainer.own_version_groups", flags[flags.index("--groups_per_step") + 1]]
    return flags


def varied_reward(prompt: str, completion: str, answer: str, metadata) -> float:
    """A reward with no meaning that differs between completions (a hash of the text, in [0, 1]).
    The tiny model earns 0 on every real task, so its groups have no advantage and the weights never
    change: stale or wrongly tagged weights would then be the right ones."""
    return (sum(map(ord, completion)) % 7) / 6


class VariedTurns:
    """A two-turn environment for the multi-turn classes: any reply is answered, the episode ends
    after the second, and each turn's reward is `varied_reward` of the reply (guess_number's reward
    is 0 for the tiny model, so its weights would never move)."""

    name = "varied_turns"

    def __init__(self) -> None:
        self.turns = 0

    @staticmethod
    def train_records(seed: int):
        return ({"id": f"varied-{seed}-{i}"} for i in itertools.count())

    @staticmethod
    def eval_records(n: int) -> list[dict]:
        return [{"id": f"varied-eval-{i}"} for i in range(n)]

    def reset(self, record) -> str:
        self.turns = 0
        return "Say something, then say something else."

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turns += 1
        return "Now something else.", varied_reward("", action, "", {}), self.turns >= 2


def changed_rollouts(name: str, logs: list[str]) -> set[str]:
    """The rollout ids whose turns `name` changed, from the actor's FAULTY_ROLLOUTS_LOG lines."""
    marker = FAULTY_ROLLOUTS_LOG % (name, "")
    return {
        rollout_id
        for text in logs
        for line in text.splitlines()
        if marker in line
        for rollout_id in line.split(marker, 1)[1].split()
    }


def first_trained_step(run_dir: Path, rollout_ids: set[str]) -> int | None:
    """The first step whose trained rollouts (trained_rollouts.jsonl) include one of `rollout_ids`;
    None when no step trained any."""
    path = run_dir / "trained_rollouts.jsonl"
    if not rollout_ids or not path.exists():
        return None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if rollout_ids.intersection(row["rollout_ids"]):
            return row["step"]
    return None


def run_one(name: str, out: Path, steps: int, inject_version: int, timeout_s: float) -> dict:
    run_dir, log_path = out / name, out / f"{name}.log"
    env = {**os.environ, MARKER_ENV: f"faults-live-bench-{os.getpid()}", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log_path, "wb") as log_file:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", "commands.main", "run", *run_flags(name, run_dir, steps, inject_version)],
                stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    log = log_path.read_text(errors="replace")
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    report_path = run_dir / f"{MISMATCH_REPORT}.json"
    top3 = (
        [c["fault"] for c in json.loads(report_path.read_text())["candidates"][:3]]
        if report_path.exists()
        else []
    )
    # Multi-turn classes log each turn they changed (rollout/episodes.py FAULTY_TURN_LOG): none
    # means the fault never acted (no update landed between two turns), not that it was missed.
    faulty_turns = first_faulty_step = None
    if name == "episode_version_tag":
        logs = [p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")]
        faulty_turns = sum(text.count(f"fault {name} changed model turn ") for text in logs)
        first_faulty_step = first_trained_step(run_dir, changed_rollouts(name, logs))
    else:
        # sync mode trains version v at step v + 1: the first step that trains on a faulty token
        first_faulty_step = inject_version + 1
    last = rows[-1] if rows else {}
    tags = last.get("version_tag_violations") or 0
    return {
        "fault": name,
        "faulty_turns": faulty_turns,
        "injected_at_version": inject_version,
        "rc": rc,
        "gate_stopped": rc not in (0, None) and "running gate" in log,
        "stopped_at_step": rows[-1]["step"] if rows else None,
        "steps_run": len(rows),
        "signal": last.get(SIGNAL),
        "caught_by": f"version_tag_violations {tags}" if tags else SIGNAL,
        "top3": top3,
        "named_in_top3": name in top3,
        "first_faulty_step": first_faulty_step,
        "wall_s": round(time.monotonic() - start, 1),
        "log": str(log_path),
    }


def markdown(rows: list[dict], steps: int) -> str:
    lines = [
        f"| class | injected at version | first faulty step | stopped at step (of {steps}) | gate signal | top-3 candidates | named |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stop = (
            r["stopped_at_step"]
            if r["gate_stopped"]
            else f"not stopped (rc {r['rc']}, {r['steps_run']} steps)"
        )
        signal = f"k3 {r['signal']:.2e}" if isinstance(r["signal"], (int, float)) else "n/a"
        if r["caught_by"] != SIGNAL:
            signal = f"{r['caught_by']} ({signal})"
        if r["faulty_turns"] is not None:
            stop = f"{stop}; {r['faulty_turns']} turns changed"
        lines.append(
            f"| {r['fault']} | {r['injected_at_version']} | {r['first_faulty_step'] or 'none'} | {stop} | {signal} | "
            f"{', '.join(r['top3']) or 'no report'} | {'yes' if r['named_in_top3'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="", help="comma-separated classes (default: all)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--inject_version", type=int, default=2)
    parser.add_argument("--timeout_s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=Path("runs/faults_live"))
    args = parser.parse_args()
    names = [n.strip() for n in args.faults.split(",") if n.strip()] or list(FAULTS)
    if unknown := [n for n in names if n not in FAULTS]:
        parser.error(f"--faults: unknown fault {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.monotonic()
    for i, name in enumerate(names, 1):
        row = run_one(name, args.out, args.steps, args.inject_version, args.timeout_s)
        rows.append(row)
        print(
            f"[{i}/{len(names)}] {name}: rc {row['rc']}, first faulty step {row['first_faulty_step']}, "
            f"stopped at step {row['stopped_at_step']}, "
            f"signal {row['signal']}, top3 {row['top3']}, named {row['named_in_top3']} ({row['wall_s']}s)",
            flush=True,
        )
    (args.out / "faults_live.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows, args.steps)
    (args.out / "faults_live.md").write_text(table)
    print(table)
    within = sum(
        r["gate_stopped"]
        and r["first_faulty_step"] is not None
        and r["stopped_at_step"] == r["first_faulty_step"]
        for r in rows
    )
    print(f"{within} of {len(rows)} stopped at their first faulty step; "
          f"{sum(r['named_in_top3'] for r in rows)} of {len(rows)} named in the top 3; "
          f"wall {time.monotonic() - start:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
