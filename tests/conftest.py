"""Shared fixtures: a private redis-server, the tiny model, and real service subprocesses."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from parity.config import ParityConfig, load
from parity.procs import ServiceProcess, start_redis, start_service

# vLLM on CPU: keep each engine's KV cache small so several can coexist on a 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The longest files (minutes each: whole `parity run`s, several vLLM engines), started first when
# the suite runs on several workers (scripts/test.sh), so no worker is left with one of them at the end.
LONGEST_FILES_FIRST = (
    "test_chaos.py",
    "test_resume.py",
    "test_broadcast_rollout.py",
    "test_launcher.py",
    "test_determinism.py",
    "test_faults.py",
    "test_trainer_export.py",
    "test_engine_recovery.py",
    "test_trainer_fsdp.py",
    "test_bench_shapes.py",
    "test_episode_run.py",
    "test_trainer_replay.py",
    "test_check.py",
    "test_byo_task_run.py",
    # 1-3 minutes each on 2026-12-01 (a fast day): left to alphabetical order they started last and
    # ended the suite alone on their workers.
    "test_rollout_stop.py",
    "test_trainer_compile.py",
    "test_trainer_multirank.py",
    "test_rollout_engine_wait.py",
    "test_rollout_reference.py",
    "test_run_multirank.py",
    "test_trainer_service.py",
    "test_security.py",
    "test_bad_input.py",
    "test_transport.py",
    "test_weight_sync_chaos.py",
    "test_rollout_inflight.py",
    "test_head_watch.py",
    "test_rollout_stale_kv.py",
    "test_rollout_service.py",
    "test_rollout_stream_interval.py",
    "test_openai_endpoint.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (NCCL); none here")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _restore_environment() -> Iterator[None]:
    """Undo environment changes a test module leaves behind.

    vLLM engines run in the pytest process (the check's ablation) write LD_PRELOAD, LOCAL_WORLD_SIZE,
    VLLM_DIST_IDENT, OMP_NUM_THREADS and more into os.environ; every service a later module starts
    would inherit them and run a different configuration from the one it was started with.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def config_for(home: str, **values: object) -> ParityConfig:
    """A run config built the way a command line builds it: `key=value` is `--key value` for the
    command whose own section is `home` (so `steps` is run.steps, `dtype` is home's dtype)."""
    argv = [token for key, value in values.items() for token in (f"--{key}", str(value))]
    return load(argv, home=home, environ={}).config


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A private redis-server on a free port; yields its URL and removes it afterwards. It dies with
    the test process also when that is killed before its teardown (a timeout, a ^C twice)."""
    workdir = tempfile.mkdtemp(prefix="parity-redis-")
    try:
        # No password: tests pass its URL on command lines, where a URL with a password is
        # refused (secrets travel in the environment). A password's own path: tests/test_security.py.
        server, url = start_redis(workdir, timeout_s=10.0, die_with_launcher=True, password="")
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield url
    server.stop(10.0)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The private server, flushed before each test."""
    import redis

    redis.Redis.from_url(redis_server).flushall()
    yield redis_server


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random Llama (head_dim 64, in-repo tokenizer), built once per session."""
    from parity import models

    return models.prepare("tiny")


@pytest.fixture
def start_services(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """Start `parity serve KIND ARGS` subprocesses; every one is stopped at teardown."""
    started: list[ServiceProcess] = []

    def _start(
        kind: str,
        *args: str,
        name: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
        timeout_s: float = 600.0,  # a vLLM start took 150-240+ s on the loaded 2-core CI box, and more
    ) -> ServiceProcess:
        args_list, env = list(args), dict(env or {})
        if "--auth_token" in args_list:  # secrets are refused on a command line: move it to the environment
            at = args_list.index("--auth_token")
            env[f"PARITY_{kind.upper()}_AUTH_TOKEN"] = args_list[at + 1]
            del args_list[at : at + 2]
        for flag in ("--redis_url", "--run.redis_url"):  # a URL with a password is refused there too
            if flag in args_list and "@" in args_list[args_list.index(flag) + 1]:
                at = args_list.index(flag)
                env["PARITY_RUN_REDIS_URL"] = args_list[at + 1]
                del args_list[at : at + 2]
        # die_with_launcher: a pytest worker killed before its teardown (a timeout, CI stopping it)
        # takes its services with it, instead of leaving them (and their vLLM engines) running
        service = start_service(
            kind,
            args_list,
            log_dir=tmp_path,
            env=env,
            name=name or f"{kind}{len(started)}",
            die_with_launcher=True,
        )
        started.append(service)
        if wait:
            service.wait_ready(timeout_s)
        return service

    yield _start
    for service in reversed(started):
        service.stop()
