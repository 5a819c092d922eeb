"""Chaos soak: a tiny `parity run` whose parts are SIGKILLed at random moments, resumed until done.

    python bench/chaos.py --kills 50 --seed 0 [--mode sync|async] [--engine reference|vllm]
                          [--steps N] [--out DIR] [--uninterrupted]

A seeded schedule picks, for each kill, a part (the trainer, the rollout service with its in-process
actor, vLLM's engine-core process with `--engine vllm`, the broadcast service, Redis, or the
launcher itself) and a moment: a random time after the launch started (start-up, the first
publish, mid-step), or a random delay after the next checkpoint; never later than checkpoint N-3 of
N steps, so that the run cannot end before the kill, and never more than (N-3) / kills checkpoints
after the launch began, so that every kill is made however fast the box trains (on a fast box, the
moments in seconds alone let a 50-kill run finish with 20 kills unmade). SIGKILL. A dead service
stops the launcher (exit 1, naming it); the bench then runs `parity run --resume RUN_DIR`, as a
user would (or the first command again, for a launcher killed before it wrote
RUN_DIR/config.toml).
A dead engine core is restarted by its rollout service: the bench waits for the service to log a
restarted engine and for the run to reach a checkpoint after that, then ends that launch (`went_on`;
a kill during the service's first engine start is followed by a second start, counted apart).
After the last kill the run is resumed to its end. Then the bench proves, from the run's records
and its Redis stream (the run's own redis-server, restarted on its append-only file):

- every step 1..N trained once, weight versions strictly increasing;
- every rollout trained at most once, and exactly `steps x groups_per_step x group_size` trained;
- no prompt drawn twice: no two stream entries hold the same (worker, draw index);
- prompts skipped (draws never published): at most the documented in-flight bound per kill
  (`rollout.concurrency` in async mode, `groups_per_step / rollout_workers` in sync mode);
- every published group that was not trained is counted: the entries left in the stream equal
  the trained ones plus those the trainer dropped (lost versions, staleness) or left unread;
- the version each launch's rollout service first served never went back (a resumed worker
  catches up to the trainer's restored weights before it serves);
- with `--uninterrupted` (sync mode): the trained sequence of draws equals that of the same run
  with no kills, bit for bit.

Prints one line per kill and per check; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name in the schedule, how its process is found: a fragment of its command line)
PARTS = {
    "trainer": "serve trainer",
    "rollout": "serve rollout",
    "broadcast": "serve broadcast",
    "redis": "redis-server",
    "launcher": "",
    "engine_core": "EngineCore",
}
LAUNCH_TIMEOUT_S = 900.0
KILL_MARGIN_STEPS = 3  # every kill lands before the run's last 3 steps (see strike)
ENGINE_RECOVERY_S = 300.0  # a killed engine core: its service builds a new one, the run goes on


@dataclass(frozen=True)
class Kill:
    part: str
    after_checkpoint: bool  # else `delay_s` after the launch started
    delay_s: float


def schedule(kills: int, seed: int, engine: str) -> list[Kill]:
    """The seeded kill plan: parts in turn from a shuffled cycle (each part about as often)."""
    rng = random.Random(seed)
    parts = [p for p in PARTS if p != "engine_core" or engine == "vllm"]
    plan: list[Kill] = []
    while len(plan) < kills:
        rng.shuffle(parts)
        for part in parts:
            if rng.random() < 0.5:
                plan.append(Kill(part, True, rng.uniform(0.0, 1.5)))
            else:
                plan.append(Kill(part, False, rng.uniform(1.0, 25.0)))
    return plan[:kills]


def run_flags(out: Path, steps: int, mode: str, engine: str, seed: int) -> list[str]:
    return ["--skip_preflight", "--model", "tiny", "--steps", str(steps), "--mode", mode,
        "--groups_per_step", "2", "--group_size", "4", "--max_tokens", "8", "--eval_size", "0",
        "--max_model_len", "256", "--startup_timeout_s", "300", "--trainer.checkpoint_every", "1",
        "--rollout.engine", engine, "--seed", str(seed), "--out", str(out), "--tracker", "none",
        "--rollout.skip_zero_variance", "false",  # every drawn prompt is published unless in flight
    ]  # fmt: skip


def next_launch(out: Path, steps: int, mode: str, engine: str, seed: int) -> list[str]:
    """The command after a kill, as a user would type it: `--resume` once the run wrote its
    config.toml; before that (a launcher killed during its start) nothing ran, so the first command
    again (`--resume` refuses a directory without config.toml)."""
    if (out / "config.toml").exists():
        return ["--resume", str(out), "--tracker", "none"]
    return run_flags(out, steps, mode, engine, seed)


def launch(
    args: list[str], marker: str, log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`parity run ARGS` with its processes marked by `marker`, its output appended to `log_path`."""
    from commands.run.supervisor import MARKER_ENV

    env = {**os.environ, **(extra_env or {}), MARKER_ENV: marker, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "commands.main", "run", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )


def checkpoint_step(run_dir: Path) -> int:
    try:
        return int((run_dir / "checkpoints" / "LATEST").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def find_part(marker: str, fragment: str) -> int | None:
    from commands.run.supervisor import marked_pids

    for pid in marked_pids(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            comm = Path(f"/proc/{pid}/comm").read_text()
        except OSError:
            continue
        if fragment in cmdline or fragment in comm:
            return pid
    return None


def wait_gone(marker: str, timeout_s: float = 60.0) -> list[int]:
    from commands.run.supervisor import marked_pids

    deadline = time.monotonic() + timeout_s
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def strike(
    kill: Kill, proc: subprocess.Popen, run_dir: Path, marker: str, steps: int, per_launch: int = 0
) -> str:
    """Wait for the kill's moment, then SIGKILL its part. Returns what happened, in words.

    A moment that would come after checkpoint `steps - KILL_MARGIN_STEPS` comes at that checkpoint
    instead: a faster box, or a resume close to the end, would otherwise finish the run before the
    kill and lose it (a kill during the last step can also come after the run needed the part).
    With `per_launch` > 0, likewise a moment that would come more than `per_launch` checkpoints
    after the one the launch started from: the steps are shared out between the kills."""
    start, last_kill_at = time.monotonic(), max(steps - KILL_MARGIN_STEPS, 0)
    if per_launch > 0:
        last_kill_at = min(last_kill_at, checkpoint_step(run_dir) + per_launch)
    if kill.after_checkpoint:
        target = min(checkpoint_step(run_dir) + 1, last_kill_at)
        while checkpoint_step(run_dir) < target and proc.poll() is None:
            if time.monotonic() - start > LAUNCH_TIMEOUT_S:
                return f"no checkpoint {target} in {LAUNCH_TIMEOUT_S:.0f}s"
            time.sleep(0.05)
    deadline = time.monotonic() + kill.delay_s
    while time.monotonic() < deadline and proc.poll() is None and checkpoint_step(run_dir) < last_kill_at:
        time.sleep(0.05)
    if proc.poll() is not None:
        return f"the launch ended first (exit {proc.returncode})"
    if kill.part == "launcher":
        proc.send_signal(signal.SIGKILL)
        return f"killed the launcher at checkpoint {checkpoint_step(run_dir)}"
    pid = find_part(marker, PARTS[kill.part])
    while pid is None and proc.poll() is None and time.monotonic() - start < LAUNCH_TIMEOUT_S:
        time.sleep(0.05)  # not started yet: kill it as soon as it exists (a start-up kill)
        pid = find_part(marker, PARTS[kill.part])
    if pid is None:
        return f"no {kill.part} process before the launch ended; nothing killed"
    os.kill(pid, signal.SIGKILL)
    return f"killed {kill.part} (pid {pid}) at checkpoint {checkpoint_step(run_dir)}"


def went_on(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> str:
    """After an engine-core kill: whether the rollout service built a new engine (logged after the
    kill: "engine restarted in" for an engine that had served, or "engine start failed" then "engine
    loaded in" for one killed during the service's first start) and the run then trained to a new
    checkpoint, in words."""
    log_path = run_dir / "logs" / "rollout0.log"
    offset = log_path.stat().st_size if log_path.exists() else 0

    def logged_since_the_kill() -> bytes:
        return log_path.read_bytes()[offset:] if log_path.exists() else b""

    def restarted() -> str:
        logged = logged_since_the_kill()
        if b"engine restarted in" in logged:
            return "engine restarted"
        if (
            b"engine start failed" in logged
            and b"engine loaded in" in logged.split(b"engine start failed")[-1]
        ):
            return "engine killed during its first start, started again"
        return ""

    start, restarted_at, how = time.monotonic(), None, ""
    while proc.poll() is None and time.monotonic() - start < timeout_s:
        if restarted_at is None and (how := restarted()):
            restarted_at = checkpoint_step(run_dir)
        if restarted_at is not None and checkpoint_step(run_dir) > restarted_at:
            took = time.monotonic() - start
            return f"{how}; the run went on to checkpoint {checkpoint_step(run_dir)} in {took:.0f}s"
        time.sleep(0.1)
    if b"Engine core initialization failed" in logged_since_the_kill():
        return f"killed during the service's first engine start: the service exited (launcher exit {proc.poll()})"
    return f"NOT RECOVERED in {time.monotonic() - start:.0f}s (launcher exit {proc.poll()})"


def soak(out: Path, kills: list[Kill], steps: int, mode: str, engine: str, seed: int) -> dict:
    """Run, kill and resume per `kills`, then resume to the end. Returns the record of what ran."""
    log_path = out.parent / f"{out.name}.launcher.log"
    args = run_flags(out, steps, mode, engine, seed)
    done: list[dict] = []
    launches = 0
    start = time.monotonic()
    per_launch = max((steps - KILL_MARGIN_STEPS) // max(len(kills), 1), 1)
    for index, kill in enumerate(kills, start=1):
        marker = uuid.uuid4().hex
        proc = launch(args, marker, log_path)
        launches += 1
        what = strike(kill, proc, out, marker, steps, per_launch)
        if kill.part == "engine_core" and proc.poll() is None and what.startswith("killed"):
            # The rollout service restarts its engine and the run goes on: wait for a checkpoint
            # after the death, then end this launch (the next kill starts from a fresh resume).
            what += "; " + went_on(proc, out, ENGINE_RECOVERY_S)
            proc.send_signal(signal.SIGKILL)
        try:
            rc = proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(30)
            what += "; the launcher did not exit within 180 s (killed)"
        left = wait_gone(marker)
        finished = rc == 0 or checkpoint_step(out) >= steps
        record = {
            "kill": index,
            "part": kill.part,
            "what": what,
            "launcher_exit": rc,
            "left_behind": len(left),
        }
        done.append(record)
        print(f"kill {index}/{len(kills)} ({kill.part}): {what}; launcher exit {rc}; "
              f"checkpoint {checkpoint_step(out)}; {time.monotonic() - start:.0f}s", flush=True)  # fmt: skip
        if finished:
            print("the run trained its last step before all kills were made; raise --steps", flush=True)
            break
        args = next_launch(out, steps, mode, engine, seed)
    final_rc = None
    if checkpoint_step(out) < steps:
        marker = uuid.uuid4().hex
        proc = launch(args, marker, log_path)  # a resume, or the first launch when nothing was killed
        launches += 1
        try:
            final_rc = proc.wait(LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            final_rc = proc.wait(30)
        wait_gone(marker)
        print(f"final resume: exit {final_rc}; {time.monotonic() - start:.0f}s", flush=True)
    return {"kills": done, "launches": launches, "final_exit": final_rc, "seconds": time.monotonic() - start}


def stream_entries(run_dir: Path) -> list[dict]:
    """Every entry of the run's stream (its own redis-server, restarted on its append-only file)."""
    import redis

    from commands.run.resume import redis_password
    from parity.procs import start_redis, stop_groups

    config = json.loads((run_dir / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="chaos-redis-") as scratch:
        data = run_dir / "logs"
        child, url = start_redis(data, password=redis_password(run_dir))
        try:
            client = redis.Redis.from_url(url)
            entries = []
            for entry_id, fields in client.xrange(config["stream"]):
                entries.append(
                    {
                        "id": entry_id.decode(),
                        "group_id": fields[b"group_id"].decode(),
                        "draw": fields.get(b"draw", b"").decode(),
                    }
                )
            return entries
        finally:
            stop_groups([child], grace_s=2.0)
            del scratch


def audit(
    run_dir: Path, steps: int, group_size: int, groups_per_step: int, kills: int, in_flight: int
) -> dict:
    """The checks of the module docstring; each is (name, passed, detail)."""
    checks: list[tuple[str, bool, str]] = []
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checks.append(
        ("steps 1..N once", [r["step"] for r in rows] == list(range(1, steps + 1)), f"{len(rows)} rows")
    )
    versions = [r["weight_version"] for r in rows]
    checks.append(
        ("versions increase", all(a < b for a, b in itertools.pairwise(versions)), str(versions[-3:]))
    )
    trained = [json.loads(line) for line in (run_dir / "trained_rollouts.jsonl").read_text().splitlines()]
    ids = [rid for t in trained for rid in t["rollout_ids"]]
    expected = steps * groups_per_step * group_size
    checks.append(("no rollout trained twice", len(ids) == len(set(ids)), f"{len(ids)} trained"))
    checks.append(("every step full", len(ids) == expected, f"{len(ids)} of {expected}"))

    entries = stream_entries(run_dir)
    draws = [e["draw"] for e in entries if e["draw"]]
    checks.append(
        ("every entry names its draw", len(draws) == len(entries), f"{len(draws)} of {len(entries)}")
    )
    duplicated = sorted({d for d in draws if draws.count(d) > 1})
    checks.append(
        ("no prompt drawn twice", not duplicated, f"{len(draws)} draws, duplicated {duplicated[:5]}")
    )
    by_producer: dict[str, set[int]] = {}
    for draw in draws:
        producer, _, index = draw.rpartition(":")
        by_producer.setdefault(producer, set()).add(int(index))
    skipped = sum(max(found) + 1 - len(found) for found in by_producer.values())
    bound = kills * in_flight
    checks.append(("prompts skipped within the in-flight bound", skipped <= bound, f"{skipped} <= {bound}"))
    trained_groups = {rid.rsplit("/", 1)[0] for rid in ids}
    published = {e["group_id"] for e in entries}
    checks.append(("every trained group was published", trained_groups <= published,
                   f"{len(trained_groups)} trained of {len(published)} published"))  # fmt: skip
    untrained = len(published - trained_groups)
    dropped = sum(int(r.get("dropped_future_version") or 0) + int(r.get("dropped_stale") or 0) for r in rows)

    rollout_log = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rollout*.log")))
    first_serving = [
        int(part.split("health: SERVING (weight_version ")[1].split(")")[0])
        for part in rollout_log.split("parity settings:")[1:]
        if "health: SERVING (" in part
    ]
    checks.append(("a worker's served version never went back", first_serving == sorted(first_serving),
                   f"first version served per launch {first_serving}"))  # fmt: skip
    for name, passed, detail in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)
    return {
        "passed": all(passed for _, passed, _ in checks),
        "checks": {name: passed for name, passed, _ in checks},
        "published_groups": len(published),
        "trained_groups": len(trained_groups),
        "untrained_groups": untrained,
        "dropped_by_trainer": dropped,
        "prompts_skipped": skipped,
        "trained_draws": [e["draw"] for e in entries if e["group_id"] in trained_groups],
    }


def kills_by_part(kills: list[dict]) -> dict[str, int]:
    made = [k for k in kills if k["what"].startswith("killed")]
    return {part: sum(1 for k in made if k["part"] == part) for part in PARTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", default="sync", choices=["sync", "async"])
    parser.add_argument("--engine", default="reference", choices=["reference", "vllm"])
    parser.add_argument("--steps", type=int, default=0, help="0: 8 x kills + 10")
    parser.add_argument("--out", default="", help="directory for the runs; default a temporary one")
    parser.add_argument(
        "--uninterrupted", action="store_true", help="also run it with no kills; compare (sync)"
    )
    args = parser.parse_args(argv)

    base = Path(args.out or tempfile.mkdtemp(prefix="chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    steps = args.steps or 8 * args.kills + 10
    plan = schedule(args.kills, args.seed, args.engine)
    print(f"chaos: {len(plan)} kills over {steps} steps ({args.mode}, {args.engine}), seed {args.seed}, in {base}",
          flush=True)  # fmt: skip
    ran = soak(base / "run", plan, steps, args.mode, args.engine, args.seed)
    in_flight = 2 if args.mode == "sync" else 8  # groups_per_step / 1 worker; rollout.concurrency
    result = audit(base / "run", steps, 4, 2, len(ran["kills"]), in_flight)
    summary = {
        "bench": "chaos",
        "seed": args.seed,
        "mode": args.mode,
        "engine": args.engine,
        "steps": steps,
        "kills_made": sum(1 for k in ran["kills"] if k["what"].startswith("killed")),
        "kills_by_part": kills_by_part(ran["kills"]),
        "launches": ran["launches"],
        "final_exit": ran["final_exit"],
        "left_behind": sum(k["left_behind"] for k in ran["kills"]),
        "seconds": round(ran["seconds"], 1),
        **{k: v for k, v in result.items() if k != "trained_draws"},
    }
    engine_kills = [k for k in ran["kills"] if k["part"] == "engine_core" and k["what"].startswith("killed")]
    if engine_kills:
        recovered = sum("went on" in k["what"] for k in engine_kills)
        at_start = sum("first start" in k["what"] and "went on" in k["what"] for k in engine_kills)
        ok = recovered == len(engine_kills)
        print(f"{'PASS' if ok else 'FAIL'}  after each engine-core kill the service built a new engine "
              f"and the run went on: {recovered} of {len(engine_kills)} ({at_start} killed during "
              f"the first start)", flush=True)  # fmt: skip
        summary["engine_core_kills_recovered"] = recovered
        summary["engine_core_kills_at_first_start"] = at_start
        summary["passed"] = summary["passed"] and ok
    if args.uninterrupted:
        straight = soak(base / "straight", [], steps, args.mode, args.engine, args.seed)
        clean = audit(base / "straight", steps, 4, 2, 0, in_flight)
        same = clean["trained_draws"] == result["trained_draws"]
        print(f"{'PASS' if same else 'FAIL'}  trained draws equal the uninterrupted run's", flush=True)
        summary["same_as_uninterrupted"] = same
        summary["passed"] = summary["passed"] and same and straight["final_exit"] == 0
    print(json.dumps(summary), flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
