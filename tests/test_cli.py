"""The `parity` command line as a newcomer meets it: help, version, each command's usage, bare flags,
`parity runs ls` before any run, and models by Hugging Face name (a locally populated cache, offline)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import parity
from commands.run import records
from parity.config.loader import config_env_keys

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = ("--trainer.run_dir", "enable_fault_injection", "auth_token", "--rollout.worker_index")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in config_env_keys(os.environ)}
    return {**env, **extra}


def _parity(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commands.main", *argv],
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=ROOT,
        timeout=120,
    )


def _options(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^  --\S+ \(", line)]


def test_version_and_bare_parity_print_and_exit_0() -> None:
    version = _parity("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"parity {parity.__version__}"
    bare = _parity()
    assert bare.returncode == 0 and bare.stdout.startswith("usage: parity") and "run" in bare.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["run"],
        ["actor"],
        ["serve", "rollout"],
        ["serve", "trainer"],
        ["serve", "broadcast"],
        ["check"],
        ["runs"],
        ["compare"],
        ["export"],
        ["models"],
    ],
)
def test_each_command_help_shows_its_own_usage(command: list[str]) -> None:
    done = _parity(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: parity {' '.join(command)} "), done.stdout[:200]


def test_short_help_lists_the_common_keys_grouped_and_help_all_lists_every_visible_key() -> None:
    short, full = _parity("run", "--help"), _parity("run", "--help-all")
    assert short.returncode == full.returncode == 0
    common = _options(short.stdout)
    assert 15 <= len(common) <= 22, len(common)
    for flag in ("--model (model.name", "--steps (run.steps", "--lr (trainer.lr", "--rollout.dtype (default"):
        assert any(line.startswith(f"  {flag}") for line in common), flag
    assert "\nSchedule\n" in short.stdout and "--help-all lists all" in short.stdout
    every = _options(full.stdout)
    assert len(every) > 120 and any(line.startswith("  --kl_coef (trainer.kl_coef") for line in every)
    # the bare-flag mapping of this command, including what needs a section
    assert "--max_tokens = --task.max_tokens" in short.stdout
    assert "--dtype: --rollout.dtype or --trainer.dtype" in short.stdout
    for text in (short.stdout, full.stdout):
        for hidden in HIDDEN:  # launcher-owned, test-only, secret
            assert hidden not in text, hidden


def test_a_service_lists_its_own_keys_that_parity_run_sets_but_never_secrets() -> None:
    trainer = _parity("serve", "trainer", "--help-all")
    assert trainer.returncode == 0
    assert "--run_dir (trainer.run_dir" in trainer.stdout  # the trainer's own key there
    assert "auth_token" not in trainer.stdout and "enable_fault_injection" not in trainer.stdout
    assert "--dtype (trainer.dtype" in trainer.stdout  # its own section wins for a bare --dtype


def test_an_ambiguous_bare_flag_is_an_error_naming_the_full_keys() -> None:
    done = _parity("run", "--dtype", "bfloat16", "--print-config")
    assert done.returncode == 2
    assert "--dtype: ambiguous" in done.stderr and "--rollout.dtype or --trainer.dtype" in done.stderr
    typo = _parity("run", "--groups_per_stp", "2", "--print-config")
    assert typo.returncode == 2 and "did you mean --groups_per_step?" in typo.stderr


def test_runs_ls_before_any_run_says_so_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert records.main(["ls", str(tmp_path / "runs")]) == 0
    assert f"no runs yet in {tmp_path / 'runs'}" in capsys.readouterr().out
    (tmp_path / "file").write_text("")
    assert records.main(["ls", str(tmp_path / "file")]) == 2  # something else is still an error


# --- models by name -------------------------------------------------------------------------------
REPO_ID = "parity-test/tiny-llama"


def _hub_cache(root: Path, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding REPO_ID (the tiny model's files) the way snapshot_download
    leaves it: blobs, a snapshot of links to them, refs/main naming the snapshot's commit."""
    repo = root / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "MANIFEST.json":
            blob = repo / "blobs" / f"blob-{path.name}"
            shutil.copyfile(path, blob)
            (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def _offline_env(hf_home: Path) -> dict[str, str]:
    return _env(HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"), HF_HUB_OFFLINE="1")


def test_a_hub_name_resolves_to_its_cached_snapshot_offline(tmp_path: Path, tiny_model: Path) -> None:
    snapshot = _hub_cache(tmp_path / "hf", tiny_model)
    env = _offline_env(tmp_path / "hf")
    located = _parity("models", "path", REPO_ID, env=env)
    assert located.returncode == 0, located.stderr
    assert Path(located.stdout.strip()) == snapshot
    probe = f"from parity import models; print(models.resolve({REPO_ID!r}))"
    resolved = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert resolved.returncode == 0, resolved.stderr
    assert Path(resolved.stdout.strip()) == snapshot
    assert json.loads((snapshot / "config.json").read_text())["hidden_size"] == 128


def test_a_hub_name_missing_offline_is_an_error_naming_model_name(tmp_path: Path) -> None:
    env = _offline_env(tmp_path / "hf")
    done = _parity("models", "path", "parity-test/not-cached", env=env)
    assert done.returncode == 2
    assert "model.name: parity-test/not-cached is not in the Hugging Face cache" in done.stderr
    assert "HF_HUB_OFFLINE=1" in done.stderr
    run = _parity("run", "--model", "parity-test/not-cached", "--out", str(tmp_path / "run"), env=env)
    assert run.returncode == 2 and "parity run: error: model.name: parity-test/not-cached" in run.stderr
    assert "model.model" not in run.stderr


def test_models_path_accepts_a_directory_as_model_does(tmp_path: Path, tiny_model: Path) -> None:
    done = _parity("models", "path", str(tiny_model))
    assert done.returncode == 0 and Path(done.stdout.strip()) == tiny_model
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = _parity("models", "path", str(empty))
    assert bad.returncode == 2 and "model.name:" in bad.stderr and "without a config.json" in bad.stderr


@pytest.mark.slow  # one broadcast service process
def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_service_goes_on(start_services) -> None:
    import signal
    import time

    import grpc

    from parity.v1 import broadcast_pb2, broadcast_pb2_grpc

    service = start_services("broadcast", timeout_s=240)
    os.kill(service.proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    # faulthandler heads the thread that took the signal "Current thread"; when the kernel hands
    # SIGUSR1 to a gRPC core thread (no Python frames) every Python thread is headed "Thread".
    # The main thread's stack ends in runpy's module entry, so its last line marks a full dump.
    while "in _run_module_as_main" not in (log := service.log_path.read_text()):
        assert service.proc.poll() is None and time.monotonic() < deadline, log[-2000:]
        time.sleep(0.1)
    dump = log.split("(most recent call first)", 1)[1]
    assert 'File "' in dump and "services/broadcast/server.py" in dump  # Python stacks, not a header
    with grpc.insecure_channel(service.address) as channel:
        stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(channel)
        status = stub.GetStatus(broadcast_pb2.WeightBroadcastServiceGetStatusRequest(), timeout=10)
    assert status.latest_version == 0 and service.proc.poll() is None
