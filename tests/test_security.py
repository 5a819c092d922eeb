"""Secrets stay off command lines and out of logs; the private Redis needs a password and keeps an AOF.

- `test_private_redis_*`: the server `parity run` (and the test fixtures) start refuses a client
  without the password, has appendonly yes / appendfsync everysec, keeps both in a 0600 config file,
  and its command line holds no password.
- `test_parity_run_puts_no_secret_on_any_command_line`: a real `parity run` (tiny model, private
  Redis). While it runs, every process of the run (found by its marker) is read from /proc: the
  secrets are taken from the children's environments (the auth token, the Redis password in
  PARITY_RUN_REDIS_URL), and no process's /proc/<pid>/cmdline may contain any of them. Afterwards no
  file in the run directory (logs, config.toml, config.json, summary) holds one either, except the
  private Redis's own redis.conf (mode 0600).
- `test_trainer_off_loopback_without_a_token_exits_2`: one line naming the field, exit 2.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from commands.run.supervisor import MARKER_ENV, marked_pids
from parity.procs import start_redis, stop_groups
from parity.url_secrets import redact_url


def test_private_redis_requires_a_password_and_keeps_an_aof(tmp_path: Path) -> None:
    child, url = start_redis(tmp_path)
    try:
        password = url.split("://:", 1)[1].split("@", 1)[0]
        assert len(password) == 32
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=child.port, socket_timeout=2).ping()
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        conf = tmp_path / "redis" / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        assert password.encode() not in Path(f"/proc/{child.proc.pid}/cmdline").read_bytes()
        assert password not in redact_url(url) and redact_url(url).startswith("redis://:***@127.0.0.1:")
    finally:
        stop_groups([child], grace_s=5.0)


def _secrets_of(environ: bytes) -> set[str]:
    found = set()
    for entry in environ.split(b"\0"):
        key, _, value = entry.decode(errors="replace").partition("=")
        if key.endswith("_AUTH_TOKEN") and value:
            found.add(value)
        if key == "PARITY_RUN_REDIS_URL" and "://:" in value:
            found.add(value.split("://:", 1)[1].split("@", 1)[0])
    return found


@pytest.mark.slow
def test_parity_run_puts_no_secret_on_any_command_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    marker = uuid.uuid4().hex
    log_path = tmp_path / "launcher.log"
    flags = ["--skip_preflight", "--model", "tiny", "--steps", "2", "--groups_per_step", "2",
        "--group_size", "4", "--max_tokens", "8", "--eval_size", "4", "--out", str(out),
        "--max_model_len", "256", "--startup_timeout_s", "900"]  # fmt: skip
    env = {**os.environ, MARKER_ENV: marker, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("PARITY_") or k == MARKER_ENV}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "commands.main", "run", *flags],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    secrets: set[str] = set()
    cmdlines: dict[int, set[bytes]] = {}  # every distinct command line each process showed
    try:
        deadline = time.monotonic() + 1100
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in marked_pids(marker):
                try:
                    secrets |= _secrets_of(Path(f"/proc/{pid}/environ").read_bytes())
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:  # exited between the listing and the read
                    continue
                if cmdline:  # a process that is exiting has released its memory and reads empty
                    cmdlines.setdefault(pid, set()).add(cmdline)
            time.sleep(0.2)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log_path.read_text(errors="replace")
    assert rc == 0, output[-4000:]
    assert len(secrets) == 2, (
        "expected the run's auth token and its Redis password in the children's environments"
    )
    seen = [c for shown in cmdlines.values() for c in shown]
    assert any(b"redis-server" in c for c in seen), f"the private redis-server was never seen: {seen}"
    assert len(cmdlines) >= 5, cmdlines  # launcher, redis, broadcast, rollout (+ engine core), trainer
    leaks = [c for c in seen for s in secrets if s.encode() in c]
    assert not leaks, leaks
    assert not [s for s in secrets if s in output]
    conf = out / "logs" / "redis" / "redis.conf"  # the one file that must hold the password
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    for path in out.rglob("*"):
        if path.is_file() and path != conf:
            text = path.read_bytes()
            assert not [s for s in secrets if s.encode() in text], f"a secret is in {path}"


def test_trainer_off_loopback_without_a_token_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARITY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "commands.main", "serve", "trainer", "--host", "0.0.0.0", "--redis_url",
         "redis://127.0.0.1:1/0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "parity serve trainer: error: trainer.auth_token: required when host='0.0.0.0' is not loopback "
        "(weight-changing RPCs must not be callable by unauthenticated remote clients)"
    ]
