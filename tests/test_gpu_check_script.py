"""scripts/gpu_check.sh (and gpu_smollm2_run.sh), rehearsed on CPU: every command they run on a GPU host
accepts its arguments.

A GPU host is lent rarely and for minutes, and the script's newer steps have never run there, so a
renamed flag or config key would cost a whole lease. Here each command of the script is read from the
script itself and checked without running it:
- `parity run`: the config loads (`--print-config`), so every key exists and every value validates,
  and the run's own startup and step timeouts end a stall before the step's time limit does;
- each bench (`bench/*.py`): its argument parser accepts the arguments (the bench stops right after);
- `pytest -m gpu FILES`: every file exists and collects at least one gpu-marked test;
- `scripts/step_mismatch.py`: prints one line per step of a metrics.jsonl with the keys a run writes.
And the script's `step` itself, run here: a command that ignores SIGTERM is killed soon after its limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


class _Parsed(Exception):  # a signal that parsing succeeded, not an error
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def script_commands(text: str, out: str) -> list[tuple[str, list[str]]]:
    """(step name, argv) of every `step NAME LIMIT COMMAND...` line, with `$out` / `"$out"` replaced."""
    joined = text.replace("\\\n", " ")
    steps = []
    for line in joined.splitlines():
        if not line.startswith("step "):
            continue
        words = shlex.split(line.replace('"$out"', out).replace("$out", out))
        steps.append((words[1], words[3:]))
    return steps


def step_limits(text: str) -> dict[str, int]:
    """LIMIT_S of every `step NAME LIMIT_S COMMAND...` line, by NAME."""
    joined = text.replace("\\\n", " ")
    return {line.split()[1]: int(line.split()[2]) for line in joined.splitlines() if line.startswith("step ")}


def test_the_script_has_the_steps_the_docs_name() -> None:
    names = [name for name, _ in script_commands(SCRIPT.read_text(), "/tmp/out")]
    assert names[:2] == ["pipeline_run", "trainer_step_1.5b"], names  # the new figures first
    for expected in ("gpu_tests", "head_bf16", "trainer_step_1.5b_compile", "ipc_update"):
        assert expected in names


def _commands(kind: str, tmp_path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for name, argv in script_commands(SCRIPT.read_text(), str(tmp_path)):
        assert argv[0] == "python3", f"{name}: {argv}"
        if kind == "run" and argv[1:4] == ["-m", "commands.main", "run"]:
            found.append((name, argv[4:]))
        elif kind == "bench" and argv[1].startswith("bench/"):
            found.append((name, argv[1:]))
        elif kind == "pytest" and argv[1:3] == ["-m", "pytest"]:
            found.append((name, argv[3:]))
    assert found, f"no {kind} command in {SCRIPT}"
    return found


def print_config(args: list[str]) -> subprocess.CompletedProcess:
    """`parity run ARGS --print-config`: loads and validates the config, runs nothing."""
    return subprocess.run(
        [sys.executable, "-m", "commands.main", "run", *args, "--print-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_pipeline_runs_config_loads(tmp_path: Path) -> None:
    for name, args in _commands("run", tmp_path):
        done = print_config(args)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        config = done.stdout
        for line in ('device = "cuda"  # --rollout.device', 'engine = "reference"  # --rollout.engine'):
            assert line in config, f"{name}: {line!r} not in the printed config"


def test_the_pipeline_runs_own_timeouts_end_a_stall_inside_its_step_limit(tmp_path: Path) -> None:
    """A service that never reports SERVING, or a step that never lands, ends the run with its own
    error (naming run.startup_timeout_s / run.step_timeout_s) before the step's `timeout` cuts it off:
    after a startup that took its whole allowance, a stalled step still fails with 30 s to spare."""
    limits = step_limits(SCRIPT.read_text())
    for name, args in _commands("run", tmp_path):
        done = print_config(args)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        run = tomllib.loads(done.stdout)["run"]
        allowed = run["startup_timeout_s"] + run["step_timeout_s"]
        assert allowed + 30 <= limits[name], (
            f"{name}: run.startup_timeout_s {run['startup_timeout_s']} + run.step_timeout_s "
            f"{run['step_timeout_s']} (+ 30 s to stop) exceed the step's limit {limits[name]} s"
        )


def test_a_step_that_ignores_sigterm_is_killed_soon_after_its_limit(tmp_path: Path) -> None:
    """The script's own `step` (its text up to the first command), on a command that ignores SIGTERM
    and so do its children (a hung graceful stop): SIGKILL follows 10 s after the 1 s limit."""
    text = SCRIPT.read_text()
    prelude = text[: text.index("\n{\n")]  # variables and functions; the host check starts at `{`
    assert "step() {" in prelude
    stubborn = "step stubborn 1 bash -c 'trap \"\" TERM; sleep 60; echo outlived'"
    started = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", prelude + "\n" + stubborn],
        env={**os.environ, "OUT": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that the test can end the whole group if the step does not
    )
    try:
        output, _ = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)  # `timeout` made its own process group inside the session
        proc.communicate()
        pytest.fail("the step outlived its 1 s limit by 40 s: SIGTERM ignored and no SIGKILL followed")
    elapsed = time.monotonic() - started
    assert "stubborn exit 137 (limit 1s)" in output, output  # 128 + SIGKILL
    assert "outlived" not in output
    assert elapsed < 25, f"the step took {elapsed:.0f}s for a 1 s limit"


def _kill_session(session_id: int) -> None:
    """SIGKILL every process of the session `session_id` (Linux: the 6th field of /proc/PID/stat)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == session_id:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(int(stat.parent.name), signal.SIGKILL)


def test_every_bench_accepts_its_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python3 bench/X.py` runs it
    benches = _commands("bench", tmp_path)
    assert len(benches) >= 8, benches
    for name, (path, *args) in benches:
        monkeypatch.setattr(sys, "argv", [path, *args])
        with pytest.raises(_Parsed) as parsed:
            runpy.run_path(str(ROOT / path), run_name="__main__")
        if "--device" in args:
            assert parsed.value.namespace.device == "cuda", name


def test_every_gpu_test_file_collects_gpu_tests(tmp_path: Path) -> None:
    ((name, args),) = _commands("pytest", tmp_path)
    files = [arg for arg in args if arg.startswith("tests/")]
    assert len(files) >= 4, args
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for path in files:  # gpu tests listed, or the whole module skipped for want of CUDA
        listed = any(line.startswith(path + "::") for line in lines)
        skipped = any(line.startswith(f"SKIPPED [1] {path}:") and "CUDA" in line for line in lines)
        assert listed or skipped, f"{name}: no gpu test in {path}:\n{done.stdout[-3000:]}"


def test_the_gpu_tests_step_runs_every_file_with_gpu_tests(tmp_path: Path) -> None:
    ((name, args),) = _commands("pytest", tmp_path)
    listed = {arg for arg in args if arg.startswith("tests/")}
    marked = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"\bpytest\.mark\.gpu\b", path.read_text())  # a decorator, pytestmark or a param's marks
    }
    assert len(marked) >= 5, marked
    assert marked - listed == set(), f"{name}: gpu tests that scripts/gpu_check.sh never runs"


def test_step_mismatch_prints_each_steps_k3(tmp_path: Path) -> None:
    from scripts.step_mismatch import main
    from trainer.telemetry import REQUIRED_METRICS

    keys = ("step", "reward_mean", "mismatch_k3_own_version", "mismatch_max_abs")
    assert set(keys) <= set(REQUIRED_METRICS)  # what every metrics.jsonl row holds
    rows = [
        {"step": 1, "reward_mean": 0.25, "mismatch_k3_own_version": 3.5e-06, "mismatch_max_abs": 0.01},
        {"step": 2, "reward_mean": 0.5, "mismatch_k3_own_version": 4.5e-06, "mismatch_max_abs": 0.02},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = subprocess.run(
        [sys.executable, "scripts/step_mismatch.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "step 1 reward 0.25 own-version k3 3.5e-06 max 0.01",
        "step 2 reward 0.5 own-version k3 4.5e-06 max 0.02",
    ]
    assert main([str(tmp_path / "absent")]) == 0  # a run that wrote no metrics prints nothing


def test_the_smollm2_runs_config_loads(tmp_path: Path) -> None:
    """scripts/gpu_smollm2_run.sh's `parity run`, with its defaults (cuda, 16 steps, bf16)."""
    text = (ROOT / "scripts" / "gpu_smollm2_run.sh").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if "commands.main run" in line]
    values = {'"$steps"': "16", '"$device"': "cuda", '"$run"': str(tmp_path / "run"),
              '"${dtypes[@]}"': "--precision bf16 --rollout.dtype bfloat16"}  # fmt: skip
    for variable, value in values.items():
        line = line.replace(variable, value)
    args = shlex.split(line.split("commands.main run", 1)[1].split("2>&1")[0])
    assert not [arg for arg in args if "$" in arg], args
    done = print_config(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'device = "cuda"  # --rollout.device' in done.stdout
    assert 'dtype = "bfloat16"  # --rollout.dtype' in done.stdout
