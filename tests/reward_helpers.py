"""User code that the issue-18 tests load by name, the way a user's own module is loaded:
`--task tests.reward_helpers:make_task`, `--reward tests.reward_helpers:faulty`; and the Node
RewardService (clients/node/reward_server.js) started as a process for the tests that need it."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.tasks import Prompt
from rollout.tasks.records import DatasetTask

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "clients" / "node"
HANG_S = 3600.0


def make_task(seed: int = 0) -> DatasetTask:
    """A `package.module:factory` task: 12 countdown prompts, 3 held out."""
    prompts = [Prompt(f"cd-{i}", f"Count down from {i}.", str(i)) for i in range(15)]
    task = DatasetTask("countdown", prompts[:12], prompts[12:], seed=seed)
    return task


def fault_kind(prompt_id: str) -> str:
    """How `faulty` treats a prompt: about a third each raise, hang, or score (fixed by the id)."""
    return ("raise", "hang", "score")[hashlib.sha256(prompt_id.encode()).digest()[0] % 3]


def faulty(prompt: str, completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """A user reward that raises for some prompts and hangs for others (the drop-and-count test)."""
    kind = fault_kind(str(metadata.get("fault_id", prompt)))
    if kind == "raise":
        raise RuntimeError("faulty reward: this prompt raises")
    if kind == "hang":
        time.sleep(HANG_S)
    return 0.5


def start_node_reward_server(
    port_file: Path, extra_env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """clients/node/reward_server.js on a free loopback port; (process, HOST:PORT). Fails, never skips,
    without node (issue 18: CI installs it)."""
    import os

    node = shutil.which("node")
    assert node is not None, (
        "node is not installed (apt-get install nodejs npm); the Node RewardService test needs it"
    )
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "clients/node/node_modules is missing: run `bash scripts/setup.sh` (it runs npm install)"
    )
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [node, str(NODE_DIR / "reward_server.js"), "--port", "0", "--port_file", str(port_file)],
        cwd=ROOT,
        env={**os.environ, **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None:
            raise AssertionError(f"reward_server.js exited {proc.returncode}: {proc.stdout.read()}")
        assert time.monotonic() < deadline, "reward_server.js did not write its port within 30 s"
        time.sleep(0.1)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"
