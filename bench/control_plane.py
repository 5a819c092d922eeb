"""Control-plane benchmark: the real broadcast service with N simulated rollout workers, no model.

    python bench/control_plane.py --workers 10,100,1000 --versions 50 \\
        --out bench/control_plane.json --plot bench/control_plane.png

For each worker count N, two phases, each against a fresh `parity serve broadcast` started as
tests/conftest.py starts it, with an auth token in its environment (PARITY_BROADCAST_AUTH_TOKEN) that
every call below carries:

1. membership: `--procs` processes run N workers, each the rollout service's own MembershipClient
   (RegisterWorker, then Heartbeat every heartbeat_interval_s) registering the address of its
   process's gRPC server. It reports the time until all N are live, the service's CPU while idle
   with N workers heartbeating (CPU s per s, and per heartbeat), and churn: `--churn` of the workers
   die (their heartbeats stop, nothing is unregistered), are dropped after heartbeat_timeout_s and
   rejoin; the membership changes (WORKER_JOINED + WORKER_DROPPED events) and new membership epochs
   (EPOCH_STARTED events, where the service has epochs) are counted, with the time to drop and to
   rejoin. No version is published in this phase: a registered worker is a member of the data group,
   and a group of 1,000 gloo ranks on 2 cores is not a control-plane measurement.
2. notify: the same processes hold N WatchVersions streams (one channel each: one per simulated
   worker) while `--receivers` stand-in rollout workers (tests/fakes/fake_receiver.py: the real
   update protocol and checksums, no engine) are registered. This process is the trainer: it
   publishes `--versions` versions of a two-tensor model (PublishVersion, join as rank 0, send,
   WaitVersion DISTRIBUTED, next). Per version: publish -> the last of the N streams sees the
   PUBLISHED event ("notify") and the DISTRIBUTED event ("distributed": every ack in). Every stream
   must see every version once (lost / duplicated notifications; after the last publish the streams
   get up to `--drain_s` to deliver what is still queued, so a late event counts as late, not lost),
   and every receiver must ack every version exactly once (WORKER_UPDATED events; lost / duplicated
   acks).
The service's RSS is sampled after registration, after churn and after the publishes.
The last stdout line is a JSON object; `--out` appends the runs to a JSON file, `--plot` draws the
curve of every run in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

# WatchVersions filters (VersionEventKind values: PUBLISHED=1, DISTRIBUTED=5); empty = every kind.
WATCH_KINDS: dict[str, tuple[int, ...]] = {"needed": (1, 5), "all": ()}
STREAM = "parity:control-plane-bench"
# The simulator processes' event loop (--loop), passed to them in the environment.
LOOP_ENV = "PARITY_BENCH_SIM_LOOP"  # run.stream: names the notify channels (<stream>:versions:<kind>)


def log(message: str) -> None:
    print(f"[control_plane {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- simulated workers (one asyncio loop per process) ----------------------------------------------
class Simulator:
    """A process's share of the N workers: memberships (phase 1) or watchers (phase 2)."""

    def __init__(
        self,
        broadcast: str,
        token: str,
        ids: list[str],
        interval_s: float,
        kinds: tuple[int, ...] = (),
        redis: tuple[str, str] | None = None,
    ) -> None:
        self.broadcast, self.token, self.ids, self.interval_s = broadcast, token, ids, interval_s
        self.kinds = kinds  # WatchVersions filter; empty: every event kind
        self.redis = redis  # (url, stream): watch through parity.weights.version_watch, else WatchVersions
        self.watch_stats: Counter = Counter()  # VersionWatch's duplicates / resynced / reconnects
        self.address = ""
        self.tasks: dict[str, asyncio.Task] = {}
        self.clients: dict = {}
        # phase 2: per version, the arrival times of PUBLISHED / DISTRIBUTED over all streams
        self.seen: dict[str, dict[int, list[float]]] = {
            "PUBLISHED": defaultdict(list),
            "DISTRIBUTED": defaultdict(list),
        }
        self.streams_open = 0

    def join(self, worker_id: str) -> None:
        from parity.weights.membership_client import MembershipClient

        client = MembershipClient(
            self.broadcast,
            worker_id,
            self.address,
            self.token,
            self.interval_s,
            weight_version=lambda: 0,  # no version is published in the membership phase
            on_registered=lambda _latest: None,
        )
        self.clients[worker_id] = client
        self.tasks[worker_id] = asyncio.ensure_future(client.run())

    async def die(self, worker_id: str) -> None:
        """A crash: heartbeats stop, nothing is unregistered (its idle channel stays open)."""
        task = self.tasks.pop(worker_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.clients.pop(worker_id)

    async def watch(self, ready: asyncio.Event) -> None:
        from parity.server import bearer, channel
        from parity.v1 import broadcast_pb2 as pb
        from parity.v1 import broadcast_pb2_grpc

        published = pb.VERSION_EVENT_KIND_PUBLISHED
        distributed = pb.VERSION_EVENT_KIND_DISTRIBUTED
        async with channel(self.broadcast) as chan:
            await asyncio.wait_for(chan.channel_ready(), 60)
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            request = pb.WatchVersionsRequest(after_version=0, kinds=self.kinds)
            stream = stub.WatchVersions(request, metadata=bearer(self.token))
            self.streams_open += 1  # connected; the caller gives the calls a moment to reach the service
            if self.streams_open == len(self.ids):
                ready.set()
            async for reply in stream:
                kind = reply.event.kind
                if kind == published:
                    self.seen["PUBLISHED"][reply.event.version].append(time.monotonic())
                elif kind == distributed:
                    self.seen["DISTRIBUTED"][reply.event.version].append(time.monotonic())

    async def watch_redis(self, ready: asyncio.Event) -> None:
        """One watcher through parity.weights.version_watch: Redis pub/sub, caught up through gRPC."""
        from parity.v1 import broadcast_pb2 as pb
        from parity.weights.version_watch import VersionWatch

        published = pb.VERSION_EVENT_KIND_PUBLISHED
        distributed = pb.VERSION_EVENT_KIND_DISTRIBUTED
        url, stream = self.redis
        watch = VersionWatch(self.broadcast, url, stream, self.kinds, token=self.token, resync_s=30.0)

        async def subscribed() -> None:
            await asyncio.wait_for(watch.subscribed.wait(), 120)
            self.streams_open += 1
            if self.streams_open == len(self.ids):
                ready.set()

        marker = asyncio.ensure_future(subscribed())
        try:
            async for event in watch.events():
                if event.kind == published:
                    self.seen["PUBLISHED"][event.version].append(time.monotonic())
                elif event.kind == distributed:
                    self.seen["DISTRIBUTED"][event.version].append(time.monotonic())
        finally:
            marker.cancel()
            self.watch_stats.update(
                duplicates=watch.duplicates, resynced=watch.resynced, reconnects=watch.reconnects
            )

    async def main(self, conn, mode: str) -> None:
        from parity.config.base import ServiceConfig
        from parity.server import GrpcServer

        # The address the workers register: loopback, health only (no version reaches them here).
        server = GrpcServer(ServiceConfig(host="127.0.0.1", port=0, auth_token=self.token), [])
        await server.start()
        await server.set_serving(True)
        self.address = f"127.0.0.1:{server.port}"
        loop = asyncio.get_running_loop()
        watchers: list[asyncio.Task] = []
        if mode == "membership":
            for worker_id in self.ids:
                self.join(worker_id)
            conn.send("started")
        else:
            ready = asyncio.Event()
            watch = self.watch_redis if self.redis else self.watch
            watchers = [asyncio.ensure_future(watch(ready)) for _ in self.ids]
            await asyncio.wait_for(ready.wait(), 120)
            await asyncio.sleep(2.0)  # let every WatchVersions call be under way before the first publish
            conn.send("started")
        while True:
            command, arg = await loop.run_in_executor(None, conn.recv)
            if command == "kill":
                for worker_id in arg:
                    await self.die(worker_id)
            elif command == "rejoin":
                for worker_id in arg:
                    self.join(worker_id)
            elif command == "drain":  # wait until every stream here saw the last version's events
                last, timeout_s = arg
                deadline = loop.time() + timeout_s
                while loop.time() < deadline and any(
                    len(self.seen[kind].get(last, [])) < len(self.ids) for kind in self.seen
                ):
                    await asyncio.sleep(0.05)
            elif command == "stop":
                for worker_id in list(self.tasks):
                    await self.die(worker_id)
                for task in watchers:
                    task.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
                await server.stop(1.0)
                seen = {kind: dict(by_version) for kind, by_version in self.seen.items()}
                conn.send({**seen, "watch_stats": dict(self.watch_stats)})
                return
            conn.send("ok")


def simulate(
    conn,
    mode: str,
    broadcast: str,
    token: str,
    ids: list[str],
    interval_s: float,
    kinds: tuple[int, ...],
    redis: tuple[str, str] | None,
) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    simulation = Simulator(broadcast, token, ids, interval_s, kinds, redis).main(conn, mode)
    if os.environ.get(LOOP_ENV) == "uvloop":
        import uvloop

        uvloop.run(simulation)
    else:
        asyncio.run(simulation)


class Simulators:
    """`procs` simulator processes sharing `ids`."""

    def __init__(
        self,
        mode: str,
        procs: int,
        broadcast: str,
        token: str,
        ids: list[str],
        interval_s: float,
        kinds: tuple[int, ...] = (),
        redis: tuple[str, str] | None = None,
    ):
        ctx = mp.get_context("spawn")
        self.parts = max(1, min(procs, len(ids)))
        self.ids = ids
        self.procs, self.conns = [], []
        for p in range(self.parts):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=simulate,
                args=(theirs, mode, broadcast, token, ids[p :: self.parts], interval_s, kinds, redis),
            )
            proc.start()
            self.procs.append(proc)
            self.conns.append(mine)
        for conn in self.conns:
            if not conn.poll(180):
                raise TimeoutError("a simulator process did not start in 180 s")
            conn.recv()

    def command(self, command: str, worker_ids: list[str]) -> None:
        for p, conn in enumerate(self.conns):
            conn.send((command, [w for w in worker_ids if w in set(self.ids[p :: self.parts])]))
        for conn in self.conns:
            conn.recv()

    def drain(self, last_version: int, timeout_s: float) -> None:
        for conn in self.conns:
            conn.send(("drain", (last_version, timeout_s)))
        for conn in self.conns:
            conn.recv()

    def stop(self) -> list:
        out = []
        for conn in self.conns:
            try:
                conn.send(("stop", None))
                out.append(conn.recv() if conn.poll(60) else None)
            except (BrokenPipeError, EOFError):
                out.append(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        return out


# -- the service process ---------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Broadcast:
    """A real broadcast service, a stub with the token, and a thread recording every event."""

    def __init__(
        self, n: int, args: argparse.Namespace, log_dir: Path, name: str, redis_url: str = ""
    ) -> None:
        import grpc

        from parity.procs import start_service
        from parity.server import bearer
        from parity.v1 import broadcast_pb2 as pb
        from parity.v1 import broadcast_pb2_grpc

        self.pb = pb
        self.token = secrets.token_hex(16)
        self.auth = bearer(self.token)
        flags = {
            "max_workers": n + args.receivers + 16,
            "heartbeat_interval_s": args.heartbeat_interval_s,
            "heartbeat_timeout_s": args.heartbeat_timeout_s,
            "transfer_timeout_s": 120,
            "history_versions": max(256, args.versions + 8),
        }
        argv = [token for key, value in flags.items() for token in (f"--{key}", str(value))]
        # secrets in the environment only; with a Redis URL, notify_redis (auto) publishes the events
        env = {"PARITY_BROADCAST_AUTH_TOKEN": self.token, "PARITY_RUN_STREAM": STREAM}
        if redis_url:
            env["PARITY_RUN_REDIS_URL"] = redis_url
        self.service = start_service("broadcast", argv, log_dir=log_dir, env=env, name=name).wait_ready(120)
        self.address = self.service.address
        self.pid = self.service.proc.pid
        self.chan = grpc.insecure_channel(self.address)
        self.stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(self.chan)
        self.events: list[tuple[float, str, int, str]] = []
        self._stream = self.stub.WatchVersions(pb.WatchVersionsRequest(after_version=0), metadata=self.auth)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        import grpc

        try:
            for reply in self._stream:
                e = reply.event
                kind = self.pb.VersionEventKind.Name(e.kind).removeprefix("VERSION_EVENT_KIND_")
                self.events.append((time.monotonic(), kind, e.version, e.worker_id))
        except grpc.RpcError:
            pass  # cancelled at close

    def live(self) -> list:
        reply = self.stub.GetStatus(
            self.pb.WeightBroadcastServiceGetStatusRequest(), timeout=30, metadata=self.auth
        )
        return [w for w in reply.workers if w.state != self.pb.WORKER_STATE_DROPPED]

    def wait_live(self, count: int, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if len(self.live()) == count:
                return time.monotonic() - start
            time.sleep(0.1)
        raise TimeoutError(f"{count} live workers not reached in {timeout_s:.0f}s")

    def close(self) -> None:
        self._stream.cancel()
        self.chan.close()
        self.service.stop()


# -- phase 1: membership ---------------------------------------------------------------------------
def membership_phase(n: int, args: argparse.Namespace, log_dir: Path) -> dict:
    svc = Broadcast(n, args, log_dir, f"broadcast-members-{n}")
    ids = [f"sim-{i:05d}" for i in range(n)]
    sims = None
    out: dict = {}
    try:
        start = time.monotonic()
        sims = Simulators("membership", args.procs, svc.address, svc.token, ids, args.heartbeat_interval_s)
        svc.wait_live(n, 300)
        out["register_s"] = time.monotonic() - start
        out["rss_mib_registered"] = rss_mib(svc.pid)
        time.sleep(args.heartbeat_interval_s)  # every worker past its first beat
        cpu0, t0 = cpu_seconds(svc.pid), time.monotonic()
        time.sleep(args.idle_s)
        cpu_per_s = (cpu_seconds(svc.pid) - cpu0) / (time.monotonic() - t0)
        out["heartbeat_cpu_s_per_s"] = cpu_per_s
        out["heartbeat_cpu_us_each"] = cpu_per_s / (n / args.heartbeat_interval_s) * 1e6
        dying = ids[:: max(1, round(1 / args.churn))][: max(1, round(n * args.churn))]
        mark = len(svc.events)
        killed_at = time.monotonic()
        sims.command("kill", dying)
        svc.wait_live(n - len(dying), args.heartbeat_timeout_s * 3 + 60)
        out["churn_drop_s"] = time.monotonic() - killed_at
        rejoined_at = time.monotonic()
        sims.command("rejoin", dying)
        svc.wait_live(n, 300)
        out["churn_rejoin_s"] = time.monotonic() - rejoined_at
        time.sleep(1.0)  # the last events reach the watcher
        kinds = Counter(kind for _, kind, _, _ in svc.events[mark:])
        out["churn_workers"] = len(dying)
        out["churn_membership_changes"] = kinds["WORKER_JOINED"] + kinds["WORKER_DROPPED"]
        out["churn_epochs_started"] = kinds["EPOCH_STARTED"]
        out["rss_mib_after_churn"] = rss_mib(svc.pid)
    finally:
        if sims is not None:
            sims.stop()
        svc.close()
    return out


# -- phase 2: notify and acks ----------------------------------------------------------------------
def start_receiver(log_dir: Path, broadcast: str, token: str, worker_id: str):
    from parity.procs import ServiceProcess

    port_file = log_dir / f"{worker_id}.port"
    port_file.unlink(missing_ok=True)  # a previous run's receiver of the same name wrote one
    log_path = log_dir / f"{worker_id}.log"
    cmd = [sys.executable, "-m", "tests.fakes.fake_receiver", "--broadcast_address", broadcast]
    cmd += ["--worker_id", worker_id, "--port_file", str(port_file)]
    env = {**os.environ, "PARITY_AUTH_TOKEN": token}  # the token travels in the environment, never argv
    with open(log_path, "ab") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServiceProcess(name=worker_id, proc=proc, port_file=port_file, log_path=log_path)


def trainer_sender():
    """How the trainer sends a plan's tensors: through the epoch's group, held across versions."""
    from parity.weights.group import GroupHolder

    holder = GroupHolder()

    def send(tensors, plan) -> None:
        with holder.use(plan.rendezvous) as group:
            group.send(tensors, plan.bucket_bytes)

    return send, holder


def notify_phase(n: int, args: argparse.Namespace, log_dir: Path, via: str, redis: tuple[str, int]) -> dict:
    """`via` grpc: N WatchVersions streams; redis: N parity.weights.version_watch watchers (pub/sub).
    `redis` = (URL, pid) of the redis-server the service publishes every event to."""
    redis_url, redis_pid = redis
    import torch

    from parity.v1 import common_pb2
    from parity.weights import checksum

    svc = Broadcast(n, args, log_dir, f"broadcast-notify-{via}-{n}", redis_url)
    pb = svc.pb
    receivers, sims, holder = [], None, None
    out: dict = {}
    try:
        names = [f"recv-{i}" for i in range(args.receivers)]
        for worker_id in names:  # kept in `receivers` before waiting, so `finally` stops every one
            receivers.append(start_receiver(log_dir, svc.address, svc.token, worker_id))
        for receiver in receivers:
            receiver.wait_ready(120)
        svc.wait_live(len(names), 60)
        sims = Simulators(
            "notify",
            args.procs,
            svc.address,
            svc.token,
            [f"watch-{i:05d}" for i in range(n)],
            1.0,
            WATCH_KINDS[args.watch_kinds],
            (redis_url, STREAM) if via == "redis" else None,
        )
        named = [("layer.weight", torch.zeros(64, 64)), ("layer.bias", torch.zeros(64))]
        send, holder = trainer_sender()
        published, distributed = {}, {}
        mark = len(svc.events)
        cpu0 = cpu_seconds(svc.pid)
        sim_cpu0 = sum(cpu_seconds(proc.pid) for proc in sims.procs)
        redis_cpu0 = cpu_seconds(redis_pid)
        for version in range(1, args.versions + 1):
            for _, tensor in named:
                tensor.fill_(float(version))
            request = pb.PublishVersionRequest(
                version=version,
                model="control-plane-bench",
                tensors=checksum.describe(named),
                checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
            )
            published[version] = time.monotonic()
            plan = svc.stub.PublishVersion(request, timeout=30, metadata=svc.auth).plan
            if plan.rendezvous.world_size >= 2:  # 1: the service names no receiver, nothing to send
                send([t for _, t in named], plan)
            reply = svc.stub.WaitVersion(
                pb.WaitVersionRequest(version=version, state=pb.VERSION_STATE_DISTRIBUTED, timeout_s=300),
                timeout=320,
                metadata=svc.auth,
            )
            distributed[version] = time.monotonic()
            if not reply.reached:
                raise RuntimeError(f"v{version} not distributed: {reply.version}")
            time.sleep(args.gap_s)  # > 0: the streams drain before the next publish (no backlog)
        out["publish_phase_cpu_s"] = cpu_seconds(svc.pid) - cpu0
        out["service_cpu_ms_per_version"] = out["publish_phase_cpu_s"] / args.versions * 1e3
        sim_cpu = sum(cpu_seconds(proc.pid) for proc in sims.procs) - sim_cpu0
        out["watchers_cpu_ms_per_version"] = sim_cpu / args.versions * 1e3
        out["redis_cpu_ms_per_version"] = (cpu_seconds(redis_pid) - redis_cpu0) / args.versions * 1e3
        out["rss_mib_published"] = rss_mib(svc.pid)
        # a notification still queued is late, not lost: wait (bounded) until every stream has it
        drain_start = time.monotonic()
        sims.drain(args.versions, args.drain_s)
        out["drain_s"] = time.monotonic() - drain_start
        seen = [s for s in sims.stop() if s is not None]
        sims = None
        if len(seen) != max(1, min(args.procs, n)):
            raise RuntimeError("a simulator process did not report")
        stats = Counter()
        for s in seen:
            stats.update(s.pop("watch_stats"))
        if via == "redis":
            out.update({f"watch_{k}": stats[k] for k in ("duplicates", "resynced", "reconnects")})
        notify, dist, trainer = [], [], []
        lost = duplicated = 0
        for version, at in published.items():
            pubs = [t for s in seen for t in s["PUBLISHED"].get(version, [])]
            dists = [t for s in seen for t in s["DISTRIBUTED"].get(version, [])]
            lost += max(0, n - len(pubs)) + max(0, n - len(dists))
            duplicated += max(0, len(pubs) - n) + max(0, len(dists) - n)
            notify.append((max(pubs) - at) * 1e3 if pubs else float("nan"))
            dist.append((max(dists) - at) * 1e3 if dists else float("nan"))
            trainer.append((distributed[version] - at) * 1e3)
        acks = Counter((w, v) for _, kind, v, w in svc.events[mark:] if kind == "WORKER_UPDATED")
        out["epochs_started"] = sum(1 for _, kind, _, _ in svc.events if kind == "EPOCH_STARTED")
        applied = {w.worker_id: w.updates_applied for w in svc.live()}
        out.update(
            notify_ms_p50=percentile(notify, 50),
            notify_ms_p99=percentile(notify, 99),
            distributed_ms_p50=percentile(dist, 50),
            distributed_ms_p99=percentile(dist, 99),
            trainer_wait_ms_p50=percentile(trainer, 50),
            notifications_lost=lost,
            notifications_duplicated=duplicated,
            acks_expected=len(names) * args.versions,
            acks_lost=sum(1 for w in names for v in published if acks[(w, v)] == 0),
            acks_duplicated=sum(1 for count in acks.values() if count > 1),
            receivers_updates_applied=sorted(set(applied.values())),
        )
    finally:
        if holder is not None:
            holder.close()
        if sims is not None:
            sims.stop()
        for receiver in receivers:
            receiver.stop()
        svc.close()
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = (
        ("notify_ms_p99", "notify p99"),
        ("notify_ms_p50", "notify p50"),
        ("distributed_ms_p50", "all acked (DISTRIBUTED) p50"),
    )

    # a run's path and filter; runs recorded before `watch` / `watch_kinds` existed were grpc / all
    def path_of(r: dict) -> str:
        return f"{r.get('watch', 'grpc')}, {r.get('watch_kinds', 'all')}"

    filters = sorted({path_of(r) for r in runs})
    for (key, label), kinds in ((k, f) for f in filters for k in series):
        by_n = defaultdict(list)
        for r in runs:
            if path_of(r) == kinds:
                by_n[r["workers"]].append(r[key])
        ns = sorted(by_n)
        label = f"{label} (watch {kinds})" if len(filters) > 1 else label
        line = ax.plot(ns, [statistics.median(by_n[x]) for x in ns], marker="o", linewidth=1, label=label)
        for x in ns:  # the range over runs
            ax.vlines(x, min(by_n[x]), max(by_n[x]), color=line[0].get_color(), linewidth=3, alpha=0.5)
    ax.axhline(100, color="grey", linestyle="--", linewidth=1, label="goal: notify p99 100 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("simulated rollout workers (WatchVersions streams)")
    ax.set_ylabel("ms after PublishVersion")
    per_n = Counter((path_of(r), r["workers"]) for r in runs)
    ax.set_title(
        f"broadcast control plane, {os.cpu_count()} cores, {min(per_n.values())}+ runs per N and filter (bar: range)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", default="10,100,1000", help="comma-separated worker counts")
    parser.add_argument("--versions", type=int, default=50, help="versions published per run")
    parser.add_argument("--receivers", type=int, default=2, help="stand-in rollout workers that ack")
    parser.add_argument("--procs", type=int, default=4, help="simulator processes")
    parser.add_argument(
        "--watch_kinds",
        choices=sorted(WATCH_KINDS),
        default="needed",
        help="needed: each stream asks for PUBLISHED and DISTRIBUTED only (what it measures); all: every event",
    )
    parser.add_argument(
        "--gap_s", type=float, default=0.0, help="pause between a version's DISTRIBUTED and the next publish"
    )
    parser.add_argument(
        "--drain_s", type=float, default=60.0, help="after the last publish, wait up to this for late events"
    )
    parser.add_argument("--churn", type=float, default=0.1, help="fraction of workers that die and rejoin")
    parser.add_argument("--heartbeat_interval_s", type=float, default=2.0)
    parser.add_argument("--heartbeat_timeout_s", type=float, default=6.0)
    parser.add_argument("--idle_s", type=float, default=10.0, help="window of the heartbeat CPU measurement")
    parser.add_argument(
        "--watch",
        default="grpc,redis",
        help="notify paths, each a notify phase against a fresh service: grpc (N WatchVersions streams), "
        "redis (N parity.weights.version_watch watchers: Redis pub/sub, caught up through gRPC)",
    )
    parser.add_argument("--skip_membership", action="store_true", help="run the notify phase only")
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the simulator processes' event loop (the harness only: the service, Redis and the watch "
        "client code are the same); uvloop spends less of the 2 cores on the simulated workers",
    )
    parser.add_argument("--log_dir", default="", help="keep the services' logs here (default: a temp dir)")
    parser.add_argument("--out", default="", help="append the runs to this JSON file")
    parser.add_argument("--plot", default="", help="PNG of the curve of every run in --out")
    args = parser.parse_args()
    # A timeout's SIGTERM unwinds through the `finally` blocks, which stop the services started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ[LOOP_ENV] = args.loop  # read by the simulator processes (spawned: they inherit it)
    paths = [v for v in args.watch.split(",") if v]
    if not paths or set(paths) - {"grpc", "redis"}:
        parser.error("--watch: a comma-separated list of grpc, redis")
    runs = []
    with tempfile.TemporaryDirectory(prefix="parity-cp-") as tmp:
        tmp = args.log_dir or tmp
        from parity.procs import start_redis

        # A private, password-protected redis-server, as `parity run` starts one: the broadcast
        # service publishes every version event to it (broadcast.notify_redis auto), in every phase.
        redis_proc, redis_url = start_redis(Path(tmp) / "redis-cp", timeout_s=15.0)
        try:
            for n in [int(x) for x in args.workers.split(",") if x]:
                base = {
                    "workers": n,
                    "procs": args.procs,
                    "gap_s": args.gap_s,
                    "watch_kinds": args.watch_kinds,
                    "sim_loop": args.loop,
                }
                if not args.skip_membership:
                    log(f"N={n}: membership phase")
                    base.update(membership_phase(n, args, Path(tmp)))
                for via in paths:
                    log(f"N={n}: notify phase via {via} ({args.versions} versions)")
                    run = {**base, "watch": via}
                    run.update(notify_phase(n, args, Path(tmp), via, (redis_url, redis_proc.proc.pid)))
                    log(json.dumps(run))
                    runs.append(run)
        finally:
            redis_proc.stop(5.0)
    record = {"cpus": os.cpu_count(), "runs": runs}
    if args.out:
        out = Path(args.out)
        if out.exists():
            record["runs"] = json.loads(out.read_text())["runs"] + runs
        out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        plot(record["runs"], Path(args.plot))
    print(json.dumps({"cpus": os.cpu_count(), "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
