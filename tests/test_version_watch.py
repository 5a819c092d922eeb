"""parity/weights/version_watch.py against a real broadcast service and a real redis-server.

The events come from RegisterWorker / UnregisterWorker (WORKER_JOINED carries the worker's claimed
version, which numbers them here; WORKER_DROPPED is the kind the filter must keep out), so no data
plane is needed.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
from urllib.parse import urlparse

import grpc
import pytest

from parity.config import ConfigError, load
from parity.procs import start_redis
from parity.server import bearer
from parity.server import channel as grpc_channel
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc
from parity.weights.version_watch import VersionWatch, WatchUnavailable, channel
from services.broadcast import server

JOINED, DROPPED = pb.VERSION_EVENT_KIND_WORKER_JOINED, pb.VERSION_EVENT_KIND_WORKER_DROPPED
TOKEN = secrets.token_hex(8)


def _broadcast(start_services, redis_url: str, stream: str, notify: str = "auto"):
    env = {
        "PARITY_BROADCAST_AUTH_TOKEN": TOKEN,
        "PARITY_RUN_REDIS_URL": redis_url,
        "PARITY_RUN_STREAM": stream,
        "PARITY_BROADCAST_NOTIFY_REDIS": notify,
    }
    return start_services("broadcast", env=env, timeout_s=240)


async def _join(stub, first: int, last: int, drop: bool = True) -> None:
    """Workers w<first>..w<last> join (JOINED, version = their number); each then leaves (DROPPED)."""
    for i in range(first, last + 1):
        request = pb.RegisterWorkerRequest(worker_id=f"w{i}", address="127.0.0.1:1", weight_version=i)
        await stub.RegisterWorker(request, metadata=bearer(TOKEN), timeout=10)
        if drop:
            await stub.UnregisterWorker(
                pb.UnregisterWorkerRequest(worker_id=f"w{i}"), metadata=bearer(TOKEN), timeout=10
            )


async def _take(watch: VersionWatch, into: list[pb.VersionEvent], count: int) -> None:
    async for event in watch.events():
        into.append(event)
        if len(into) == count:
            return


def test_in_order_once_filtered_and_nothing_lost_across_subscribe(start_services, redis_url) -> None:
    import redis

    stream = f"t-{secrets.token_hex(4)}"
    service = _broadcast(start_services, redis_url, stream)

    async def scenario() -> tuple[list[pb.VersionEvent], VersionWatch]:
        async with grpc_channel(service.address) as chan:
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            await _join(stub, 1, 5)  # before the watch: only the catch-up read can deliver these
            watch = VersionWatch(service.address, redis_url, stream, kinds=[JOINED], resync_s=30)
            got: list[pb.VersionEvent] = []
            taking = asyncio.ensure_future(_take(watch, got, 40))
            await _join(stub, 6, 20)  # while it subscribes and catches up
            await asyncio.wait_for(watch.subscribed.wait(), 10)
            await _join(stub, 21, 39)
            while len(got) < 39:
                await asyncio.sleep(0.02)
            # the service re-publishing a batch after a Redis error: the copy must be dropped
            copy = got[-1].SerializeToString()
            assert redis.Redis.from_url(redis_url).publish(channel(stream, JOINED), copy) == 1
            await _join(stub, 40, 40)
            await asyncio.wait_for(taking, 10)
            return got, watch

    got, watch = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [(e.kind, e.version) for e in got] == [(JOINED, i) for i in range(1, 41)]
    seqs = [e.seq for e in got]
    assert seqs == sorted(set(seqs))
    assert watch.duplicates >= 1 and watch.resynced == 0 and watch.reconnects == 0


def test_the_grpc_api_takes_after_seq_and_replay_only(start_services, redis_url) -> None:
    service = _broadcast(start_services, redis_url, "t-api", notify="off")

    async def scenario() -> tuple[list[int], grpc.StatusCode]:
        async with grpc_channel(service.address) as chan:
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            await _join(stub, 1, 3)
            request = pb.WatchVersionsRequest(kinds=[JOINED], replay_only=True)
            everything = [r.event async for r in stub.WatchVersions(request, timeout=5)]
            request.after_seq = everything[0].seq
            rest = [r.event.version async for r in stub.WatchVersions(request, timeout=5)]
            try:
                bad = pb.WatchVersionsRequest(after_seq=-1)
                [r async for r in stub.WatchVersions(bad, timeout=5)]
            except grpc.aio.AioRpcError as exc:
                return rest, exc.code()
            return rest, grpc.StatusCode.OK

    rest, code = asyncio.run(scenario())
    assert rest == [2, 3] and code == grpc.StatusCode.INVALID_ARGUMENT


def test_with_notify_off_events_still_arrive_late_through_grpc(start_services, redis_url) -> None:
    service = _broadcast(start_services, redis_url, "t-off", notify="off")

    async def scenario() -> tuple[list[pb.VersionEvent], VersionWatch]:
        async with grpc_channel(service.address) as chan:
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            watch = VersionWatch(service.address, redis_url, "t-off", kinds=[JOINED], resync_s=0.2)
            got: list[pb.VersionEvent] = []
            taking = asyncio.ensure_future(_take(watch, got, 3))
            await asyncio.wait_for(watch.subscribed.wait(), 10)
            await _join(stub, 1, 3)
            await asyncio.wait_for(taking, 10)
            return got, watch

    got, watch = asyncio.run(scenario())
    assert [e.version for e in got] == [1, 2, 3] and watch.resynced == 3


def test_a_redis_restart_is_survived_without_loss_or_duplicates(start_services, tmp_path) -> None:
    workdir = tempfile.mkdtemp(prefix="parity-redis-")
    redis_proc, url = start_redis(workdir, timeout_s=10.0)
    try:
        service = _broadcast(start_services, url, "t-restart")

        async def scenario() -> tuple[list[pb.VersionEvent], VersionWatch]:
            nonlocal redis_proc
            async with grpc_channel(service.address) as chan:
                stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
                watch = VersionWatch(service.address, url, "t-restart", kinds=[JOINED], resync_s=30)
                got: list[pb.VersionEvent] = []
                taking = asyncio.ensure_future(_take(watch, got, 9))
                await asyncio.wait_for(watch.subscribed.wait(), 10)
                await _join(stub, 1, 3)
                while len(got) < 3:
                    await asyncio.sleep(0.02)
                redis_proc.stop(5.0)
                await _join(stub, 4, 6)  # while Redis is down: the publisher retries them
                parsed = urlparse(url)
                redis_proc, _ = start_redis(workdir, password=parsed.password, port=parsed.port)
                await _join(stub, 7, 9)
                await asyncio.wait_for(taking, 20)
                return got, watch

        got, watch = asyncio.run(scenario())
        assert [e.version for e in got] == list(range(1, 10))
        assert watch.reconnects >= 1
    finally:
        redis_proc.stop(5.0)
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_frozen_redis_is_caught_by_the_watchdog_and_survived(start_services, tmp_path) -> None:
    """SIGSTOP: the connection stays open and silent (no FIN, no error), so only the watchdog's
    unanswered PING can tell; the watch reconnects once Redis runs again, and nothing is lost."""
    import signal

    workdir = tempfile.mkdtemp(prefix="parity-redis-")
    redis_proc, url = start_redis(workdir, timeout_s=10.0)
    try:
        service = _broadcast(start_services, url, "t-frozen")

        async def scenario() -> tuple[list[pb.VersionEvent], VersionWatch]:
            async with grpc_channel(service.address) as chan:
                stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
                watch = VersionWatch(
                    service.address, url, "t-frozen", kinds=[JOINED], timeout_s=1.0, resync_s=0.5
                )
                got: list[pb.VersionEvent] = []
                taking = asyncio.ensure_future(_take(watch, got, 6))
                await asyncio.wait_for(watch.subscribed.wait(), 10)
                await _join(stub, 1, 3)
                while len(got) < 3:
                    await asyncio.sleep(0.02)
                redis_proc.proc.send_signal(signal.SIGSTOP)
                try:
                    for _ in range(200):  # PING after 0.5 s of quiet, no PONG in 1 s: reconnect
                        if watch.reconnects:
                            break
                        await asyncio.sleep(0.05)
                    assert watch.reconnects >= 1, "the watchdog did not notice the frozen Redis"
                finally:
                    redis_proc.proc.send_signal(signal.SIGCONT)
                await _join(stub, 4, 6)
                await asyncio.wait_for(taking, 20)
                return got, watch

        got, watch = asyncio.run(scenario())
        assert [e.version for e in got] == [1, 2, 3, 4, 5, 6] and watch.reconnects >= 1
    finally:
        redis_proc.stop(5.0)
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_outage_past_the_limit_is_reported_with_its_cause(start_services, redis_url) -> None:
    service = _broadcast(start_services, redis_url, "t-down", notify="off")
    dead = "redis://127.0.0.1:9/0"  # the discard port: nothing listens

    async def scenario() -> None:
        watch = VersionWatch(service.address, dead, "t-down", timeout_s=0.5, outage_timeout_s=1.0)
        async for _ in watch.events():
            pass

    with pytest.raises(WatchUnavailable, match=r"no connection for \d+s .*redis"):
        asyncio.run(asyncio.wait_for(scenario(), 15))


def test_notify_redis_is_checked_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"^broadcast\.notify_redis:"):
        load(["--notify_redis", "always"], home="broadcast", environ={})
    assert server.main(["--notify_redis", "on"]) == 2
    assert "broadcast.notify_redis: 'on' needs run.redis_url" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^kinds:"):
        VersionWatch("127.0.0.1:1", "redis://127.0.0.1:1/0", "s", kinds=[99])
