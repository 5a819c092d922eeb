"""Start services as real subprocesses and wait on their health checks.

Used by the tests and by the `parity run` launcher. A child is started in its own process group so
that stopping it also stops everything it spawned (vLLM's engine core, for one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_healthy(
    address: str, timeout_s: float = 60.0, service: str = "", proc: subprocess.Popen | None = None
) -> None:
    """Block until grpc.health.v1 reports SERVING at `address`; raise TimeoutError/RuntimeError."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    with grpc.insecure_channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {proc.returncode} before serving")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s (last: {last_error})")


@dataclass
class ServiceProcess:
    """A running `parity serve ...` child."""

    name: str
    proc: subprocess.Popen
    port_file: Path
    log_path: Path
    port: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 180.0) -> ServiceProcess:
        """Wait for the port file, then for SERVING."""
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start in {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)
        self.port = int(self.port_file.read_text())
        wait_healthy(self.address, max(1.0, deadline - time.monotonic()), proc=self.proc)
        return self

    def log_tail(self, n_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n_lines:])
        except OSError:
            return "<no log>"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the process group, then SIGKILL after `timeout_s`."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(10)
        else:
            self.signal(signal.SIGKILL)  # reap stragglers left in the group
        return self.proc.returncode


def start_service(
    kind: str,
    args: list[str],
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> ServiceProcess:
    """Start `parity serve KIND ARGS...` on a free port, writing its port to a file when serving."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="parity-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    name = name or kind
    port_file = log_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "parity.cli", "serve", kind, "--port_file", str(port_file), *args]
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
    return ServiceProcess(name=name, proc=proc, port_file=port_file, log_path=log_path)
