"""Start services (and a private redis-server) as real subprocesses, wait on them, stop them.

Used by the tests and by the `parity run` supervisor.

Invariants:
- A child is started in its own process group, so stopping it also stops everything it spawned
  (vLLM's engine core, for one).
- A multiprocessing child of a parity command (vLLM's engine core and its workers under
  `parity serve rollout`) dies with the process that spawned it (`die_with_parent`): a service
  killed alone (SIGKILL of its pid, the OOM killer, a crash) leaves no engine behind. Without it the
  engine core lived on with parent pid 1 until someone killed it by hand.
- A child started with `die_with_launcher=True` (every child of `parity run`) is SIGKILLed by the
  kernel when the process that started it dies, by any means: a SIGKILLed `parity run` leaves no
  service and no redis-server behind. It is set in the child before it execs the command
  (`_exec_dying_with`), so it covers non-Python children too. What they kept survives a kill -9 by
  design (Redis's append-only file, the trainer's checkpoints, unacked rollouts); `parity run
  --resume` picks it up. The starting thread must outlive the child (PR_SET_PDEATHSIG follows the
  thread): the launcher starts children from its main thread.
- `stop_groups` is bounded: SIGTERM to every group at once, wait up to `grace_s` for the leaders,
  then SIGKILL every group, also those whose leader already exited (stragglers). It never raises for
  a child that is already gone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from parity import health
from parity.ports import free_port

PARENT_PID_ENV = "PARITY_PARENT_PID"


def mark_as_parent() -> None:
    """Tell the children this process starts from now on its pid (`die_with_parent` reads it): a
    child whose parent is pid 1 can then tell a parent that *is* pid 1 (a container's entrypoint)
    from an orphan adopted by init."""
    os.environ[PARENT_PID_ENV] = str(os.getpid())


def _marked_parent() -> int | None:
    try:
        return int(os.environ.get(PARENT_PID_ENV, ""))
    except ValueError:
        return None


def parent_is_gone(before: int, now: int, marked: int | None) -> bool:
    """Whether the parent died before PR_SET_PDEATHSIG took effect: the parent pid changed
    (`before`, read before the prctl; `now`, after), or it was already pid 1 (adopted by init)
    when the parent had not marked itself as pid 1."""
    return now != before or (before == 1 and marked != 1)


@contextlib.contextmanager
def temporary_environment(**values: str) -> Iterator[None]:
    """`values` in this process's environment for the block (what a library reads with getenv when
    it builds something), then the previous values back, unset ones unset."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def die_with_parent(marked: int | None = None) -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits; exit now if it already has.

    Called at import time in every multiprocessing child whose main module is `commands.main` (it
    imports that module as `__mp_main__`; see commands.main). PR_SET_PDEATHSIG follows the parent
    *thread* that spawned the child: vLLM's engine core is spawned from a thread of the service's
    default executor (`asyncio.to_thread`), whose threads live until the event loop closes, and the
    engine core spawns its workers from its main thread. Then it marks itself (`mark_as_parent`)
    for its own children. `marked`: the parent's pid when the caller knows it (else the parent's
    mark, if any)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    if marked is None:
        marked = _marked_parent()
    parent = os.getppid()
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        print(
            f"parity: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this process may "
            "outlive its parent",
            file=sys.stderr,
        )
    if parent_is_gone(parent, os.getppid(), marked):
        os._exit(1)  # the parent is already gone
    mark_as_parent()


# Run as `python -I -S -c _PDEATHSIG_EXEC LAUNCHER_PID CMD...`: ask to be SIGKILLed when the parent
# dies, exit if it is already gone (the pid check comes after the prctl, so there is no gap), then
# become CMD (the setting survives exec for a binary that is not set-uid or file-capable).
_PDEATHSIG_EXEC = """import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    print("parity: prctl(PR_SET_PDEATHSIG) failed: this process may outlive its launcher", file=sys.stderr)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _exec_dying_with(cmd: list[str], die_with_launcher: bool) -> list[str]:
    """`cmd`, started so that it dies with this process when `die_with_launcher` (Linux only)."""
    if not die_with_launcher or not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd]


class _AfterForkKey:
    """A long-lived object to register `die_with_parent` under (multiprocessing keeps it weakly)."""


_AFTER_FORK_KEY = _AfterForkKey()


def children_die_with_this_process() -> None:
    """Children that multiprocessing starts with its `fork` method die with this process too.

    A forked child does not import `commands.main` as its main module (only `spawn` does, see
    `die_with_parent`); vLLM forks its engine core where nothing forces `spawn` (on GPU, by
    default). multiprocessing runs its after-fork hooks in every child it forks."""
    import multiprocessing.util

    mark_as_parent()  # spawned children (commands.main as __mp_main__) read it too
    multiprocessing.util.register_after_fork(_AFTER_FORK_KEY, lambda _key: die_with_parent())


def wait_healthy(
    address: str, timeout_s: float = 60.0, service: str = "", proc: subprocess.Popen | None = None
) -> None:
    """Block until grpc.health.v1 reports SERVING at `address`; raise TimeoutError/RuntimeError."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {address} exited with code {proc.returncode} before serving")
        serving, last_error = health.check(address, service, timeout_s=2.0, wait_for_ready=False)
        if serving:
            return
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

    def read_port(self) -> bool:
        """Pick up the port once the child has written its port file; whether the port is known."""
        if not self.port and self.port_file.exists():
            with contextlib.suppress(ValueError):
                self.port = int(self.port_file.read_text())
        return bool(self.port)

    def wait_ready(self, timeout_s: float = 180.0) -> ServiceProcess:
        """Wait for the port file, then for SERVING."""
        deadline = time.monotonic() + timeout_s
        while not self.read_port():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start in {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)
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
        """SIGTERM the process group, then SIGKILL it after `timeout_s` (see `stop_groups`)."""
        stop_groups([self], grace_s=timeout_s, kill_wait_s=10.0)
        return self.proc.returncode


def stop_groups(
    children: Sequence[ServiceProcess], grace_s: float, kill_wait_s: float = 5.0
) -> dict[str, float]:
    """Stop every child's process group; returns the seconds each leader took to exit (<= grace_s).

    SIGTERM goes to every live group at once, so the children shut down in parallel and the whole
    call takes at most `grace_s + kill_wait_s` per child that ignores SIGKILL (none should). Then
    SIGKILL goes to every group, leader alive or not: what is left in a group is a straggler.
    """
    started = time.monotonic()
    for child in children:
        if child.proc.poll() is None:
            child.signal(signal.SIGTERM)
    deadline = started + grace_s
    took = {}
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        took[child.name] = time.monotonic() - started
    for child in children:
        child.signal(signal.SIGKILL)  # whatever is left in the group, leader or stragglers
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(kill_wait_s)
    return took


def start_service(
    kind: str,
    args: list[str],
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
    name: str | None = None,
    die_with_launcher: bool = False,
) -> ServiceProcess:
    """Start `parity serve KIND ARGS...` on a free port, writing its port to a file when serving.

    The port file is an instance value of the service's config section, passed in its environment
    (PARITY_<KIND>_PORT_FILE) like every other value a launcher sets; `args` are the caller's own."""
    from parity.config import env_for

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="parity-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    name = name or kind
    port_file = log_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "commands.main", "serve", kind, *args]
    child_env = {**os.environ, **(env or {}), **env_for(kind, port_file=str(port_file))}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            _exec_dying_with(cmd, die_with_launcher),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
    return ServiceProcess(name=name, proc=proc, port_file=port_file, log_path=log_path)


def write_redis_conf(workdir: Path, password: str) -> Path:
    """The private server's config file, mode 0600: its password never goes on an argv."""
    path = workdir / "redis.conf"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    lines = ["appendonly yes", "appendfsync everysec"]
    if password:
        lines.append(f"requirepass {password}")
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def start_redis(
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    proc_title: str = "",
    timeout_s: float = 15.0,
    attempts: int = 3,
    adopt: Callable[[ServiceProcess], None] | None = None,
    password: str | None = None,
    port: int = 0,
    die_with_launcher: bool = False,
) -> tuple[ServiceProcess, str]:
    """A private redis-server on a free loopback port: (its process, its URL).

    It requires a password (`password`; None draws a random one, "" means none) and keeps an
    append-only file (`appendfsync everysec`: an acked entry survives a kill -9 of Redis, at most
    the last second is at risk on a machine crash). Both are in `redis.conf` (mode 0600) under
    `log_dir/redis`, with its data; the URL (`redis://:PASSWORD@127.0.0.1:PORT/0`) carries the
    password, so callers pass it through the environment and log it through `redact_url`.
    `port` restarts a server on the port it had (same directory: it replays its append-only file).
    `proc_title` is appended to the process title (redis rewrites its title over its environment, so a
    marker meant to be found there must be in the title). `adopt` is called with each child as soon
    as it is spawned, before waiting on it, so a caller's cleanup covers a start that is interrupted.
    A port lost to a race is retried on another port, `attempts` times in all.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH: install it (apt-get install redis-server)")
    import redis

    log_dir = Path(log_dir)
    workdir = log_dir / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "redis.log"
    if password is None:
        password = secrets.token_hex(16)
    conf = write_redis_conf(workdir, password)
    child = None
    for _attempt in range(attempts if not port else 1):
        bind_port = port or free_port()
        cmd = [binary, str(conf), "--port", str(bind_port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--dir", str(workdir), "--logfile", str(log_path)]
        if proc_title:
            cmd += ["--proc-title-template", f"{{title}} {{listen-addr}} {proc_title}"]
        proc = subprocess.Popen(
            _exec_dying_with(cmd, die_with_launcher),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        child = ServiceProcess(name="redis", proc=proc, port_file=workdir / "unused", log_path=log_path)
        child.port = bind_port
        if adopt is not None:
            adopt(child)
        client = redis.Redis(port=bind_port, password=password or None, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                client.ping()
                auth = f":{password}@" if password else ""
                return child, f"redis://{auth}127.0.0.1:{bind_port}/0"
            time.sleep(0.05)
        stop_groups([child], grace_s=2.0)  # lost the port race or too slow: try another port
    raise RuntimeError(f"redis-server did not start:\n{child.log_tail() if child else ''}")
