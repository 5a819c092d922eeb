"""Child-process supervision for `parity run`: start, watch, report, and always clean up.

Invariants:
- Every child (redis-server, broadcast, trainer, rollout services) runs in its own process group
  (`start_new_session`), so stopping a child stops everything it spawned (vLLM's engine core too).
- Every child dies with the launcher (`parity.procs`, `die_with_launcher`): a SIGKILLed `parity run`
  leaves no service and no redis-server running.
- Every child's environment carries `PARITY_RUN_MARKER=<marker>`; grandchildren inherit it, so a
  test can prove that nothing survived by scanning /proc for the marker. vLLM's engine core and
  worker rewrite their process title over the memory /proc/PID/environ reads (setproctitle), so
  there the marker goes in the title instead (`VLLM_PROCESS_NAME_PREFIX`, read from the command
  line).
- `stop_all` is idempotent and bounded: SIGTERM to every group at once, wait `grace_s`, SIGKILL what
  is left, and SIGKILL each group again even when its leader already exited (stragglers); that is
  `parity.procs.stop_groups`. SIGINT and SIGTERM are held off while it runs, so a second Ctrl-C
  cannot leave orphans behind.
- A child that exits when it was not expected to (`expect_exit`) raises `ChildDied`, naming the
  child, its exit code (or signal) and the last lines of its log.
- Each service traces as itself (`trace_env`): an `OTEL_SERVICE_NAME` given to `parity run` becomes
  `NAME-broadcast`, `NAME-trainer` and `NAME-rollout` in the children, and each child's resource
  carries `service.instance.id=<child name>.<marker>` (rollout0, rollout1, ... stay apart).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from parity import health
from parity.procs import ServiceProcess, start_redis, start_service, stop_groups

MARKER_ENV = "PARITY_RUN_MARKER"
VLLM_TITLE_PREFIX_ENV = "VLLM_PROCESS_NAME_PREFIX"  # vLLM titles its processes PREFIX::EngineCore
REDIS_LOST_GRACE_S = 2.0


def trace_env(kind: str, name: str, marker: str, environ: dict[str, str]) -> dict[str, str]:
    """The OpenTelemetry variables child `name` (a `parity serve KIND`) gets (module docstring).
    A `service.instance.id` the user set in OTEL_RESOURCE_ATTRIBUTES is kept."""
    env: dict[str, str] = {}
    if environ.get("OTEL_SERVICE_NAME", "").strip():
        env["OTEL_SERVICE_NAME"] = f"{environ['OTEL_SERVICE_NAME'].strip()}-{kind}"
    attributes = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip().strip(",")
    keys = {pair.split("=", 1)[0].strip() for pair in attributes.split(",") if pair.strip()}
    if "service.instance.id" not in keys:
        env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(
            filter(None, [attributes, f"service.instance.id={name}.{marker}"])
        )
    return env


class ChildDied(RuntimeError):
    """A supervised child exited unexpectedly."""

    def __init__(self, name: str, returncode: int | None, log_tail: str) -> None:
        self.name = name
        self.returncode = returncode
        self.log_tail = log_tail
        super().__init__(
            f"{name} exited unexpectedly ({describe_exit(returncode)})\n--- last lines of {name}'s log ---\n{log_tail}"
        )


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        if -returncode == signal.SIGKILL:
            return "killed by SIGKILL: out of memory? see `dmesg`"
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM inside the block (cleanup must finish)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class Supervisor:
    """Owns the children of one run. Use as a context manager: exit always stops everything."""

    log_dir: Path
    marker: str
    children: dict[str, ServiceProcess] = field(default_factory=dict)
    expect_exit: set[str] = field(default_factory=set)
    # Children whose exit 0 means their work is done, at any moment (the trainer: a resumed one can
    # train its last steps from the stream while the rollout services are still starting).
    may_finish: set[str] = field(default_factory=set)
    stop_seconds: dict[str, float] = field(default_factory=dict)
    # The grace period the exit's stop_all gives every child. Once Redis is gone the services cannot
    # finish a step or checkpoint (they wait for Redis), so it shrinks to REDIS_LOST_GRACE_S then.
    exit_grace_s: float = 15.0

    def __enter__(self) -> Supervisor:
        self.log_dir = self.log_dir.resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all(self.exit_grace_s)

    @property
    def env(self) -> dict[str, str]:
        prefix = os.environ.get(VLLM_TITLE_PREFIX_ENV, "VLLM")
        return {
            MARKER_ENV: self.marker,
            "PYTHONUNBUFFERED": "1",
            VLLM_TITLE_PREFIX_ENV: f"{prefix}[{MARKER_ENV}={self.marker}]",  # module docstring
        }

    # --- starting -----------------------------------------------------------------------------
    def start_redis(self, timeout_s: float = 15.0, password: str | None = None) -> str:
        """A private redis-server (log_dir/redis.log) on a free loopback port; returns its URL.

        `password` restarts the run's server (`parity run --resume`): the same data directory, whose
        append-only file it replays, and the password it had (None draws a new one)."""
        if shutil.which("redis-server") is None:  # the launcher can do without one: say how
            raise RuntimeError(
                "redis-server is not on PATH: install it (apt-get install redis-server) or pass --redis_url"
            )

        def adopt(child: ServiceProcess) -> None:  # before the wait: stop_all covers an interrupted start
            self.children["redis"] = child

        _child, url = start_redis(
            self.log_dir,
            env=self.env,
            proc_title=f"{MARKER_ENV}={self.marker}",
            timeout_s=timeout_s,
            adopt=adopt,
            password=password,
            die_with_launcher=True,
        )
        return url

    def start(self, kind: str, name: str, env: dict[str, str]) -> ServiceProcess:
        """Start `parity serve KIND` as a child named `name` (its log: log_dir/NAME.log).

        Its config comes from `env` (PARITY_CONFIG and instance values), never from argv."""
        traced = trace_env(kind, name, self.marker, dict(os.environ))
        child = start_service(
            kind,
            [],
            log_dir=self.log_dir,
            env={**self.env, **traced, **env},
            name=name,
            die_with_launcher=True,
        )
        self.children[name] = child
        return child

    def wait_ready(self, names: list[str], timeout_s: float) -> None:
        """Wait until each named child is SERVING, failing fast if any child dies meanwhile.

        A child in `may_finish` (the trainer) that exits 0 before it was seen SERVING has done its
        work (its rollouts were already queued) and counts as ready; from then on it is expected to
        be gone. On a loaded box a two-step trainer finished between two polls."""
        pending = list(names)
        deadline = time.monotonic() + timeout_s
        while pending:
            self.check()  # a child in may_finish that exited 0 is expected to be gone from here on
            for name in [n for n in pending if n in self.expect_exit]:
                pending.remove(name)
            for name in list(pending):
                child = self.children[name]
                if child.read_port() and health.check(child.address, timeout_s=1.0, wait_for_ready=False)[0]:
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {n} ---\n{self.children[n].log_tail(15)}" for n in pending)
                raise TimeoutError(f"{', '.join(pending)} not SERVING after {timeout_s:.0f}s\n{tails}")
            if pending:
                time.sleep(0.25)

    # --- watching -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ChildDied for the first child that exited without being expected to."""
        for name, child in self.children.items():
            if name in self.expect_exit:
                continue
            if child.proc.poll() == 0 and name in self.may_finish:
                self.expect_exit.add(name)
                continue
            if child.proc.poll() is not None:
                if name == "redis":
                    self.exit_grace_s = min(self.exit_grace_s, REDIS_LOST_GRACE_S)
                raise ChildDied(name, child.proc.returncode, child.log_tail(20))

    def pids(self) -> dict[str, int]:
        return {name: child.proc.pid for name, child in self.children.items()}

    # --- stopping -----------------------------------------------------------------------------
    def stop_all(self, grace_s: float = 15.0) -> dict[str, str]:
        """Stop every child (rollouts and trainer first, then broadcast and redis); return how each ended."""
        order = sorted(self.children.values(), key=lambda c: {"redis": 2, "broadcast": 1}.get(c.name, 0))
        with signals_held():
            first = [c for c in order if c.name not in ("redis", "broadcast")]
            took = {
                **stop_groups(first, grace_s),
                **stop_groups([c for c in order if c not in first], grace_s),
            }
        for name, seconds in took.items():
            self.stop_seconds.setdefault(name, seconds)
        return {c.name: describe_exit(c.proc.returncode) for c in order}


def marked_pids(marker: str) -> list[int]:
    """Pids of live processes whose environment or command line carries PARITY_RUN_MARKER=marker.

    Zombies are excluded (they hold no resources and vanish when reaped).
    """
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if needle not in environ and needle not in (entry / "cmdline").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


class MetricsFollower:
    """Reads new complete lines of the trainer's metrics.jsonl as they are appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        new_rows = []
        for line in chunk[: end + 1].splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):
                    new_rows.append(json.loads(line))
        self.rows.extend(new_rows)
        return new_rows


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_line(
    row: dict,
    done: int,
    total_steps: int,
    started_at: float,
    first_step_at: float | None,
    now: float,
    resumed_at: int = 0,
) -> str:
    """`step 3/20 v3 reward 0.41 mismatch k3 own 2.1e-06 (max 3e-04) drift 4e-03 lag 0.60 tok/s 212 ... ETA 4m02s`.

    `done` is the number of steps finished; the ETA extrapolates the mean time per step since the
    first one (the first step also pays for startup, so it is left out). A resumed run passes the
    step it resumed at: only the steps of this process count for the rate. A value the step could
    not measure (null) prints as `-`.
    """
    own = (
        f"own {_fmt(row.get('mismatch_k3_own_version'), '.1e')} "
        f"(max {_fmt(row.get('mismatch_max_abs_own_version'), '.1e')})"
    )
    eta = "-"
    if first_step_at is not None and done - resumed_at > 1:
        per_step = (now - first_step_at) / (done - resumed_at - 1)
        eta = format_duration(per_step * (total_steps - done))
    return (
        f"step {done}/{total_steps} v{row.get('weight_version', '-')} "
        f"reward {_fmt(row.get('reward_mean'), '.3f')} "
        f"mismatch k3 {own} drift {_fmt(row.get('policy_drift_k3'), '.1e')} "
        f"lag {_fmt(row.get('lag_mean'), '.2f')} "
        f"tok/s {_fmt(row.get('tokens_per_s'), '.0f')} "
        f"elapsed {format_duration(now - started_at)} ETA {eta}"
    )
