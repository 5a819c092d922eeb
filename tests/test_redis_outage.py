"""Redis killed with kill -9 and restarted: the queue, the trainer and the actor wait it out.

Every test runs its own private redis-server (password, append-only file, `parity.procs.start_redis`)
and restarts it on the same port and directory after the kill, so it replays its AOF.
- `test_queue_*` (fast): a producer and a consumer thread on the real RolloutQueue across the
  outage; every published group is consumed, none lost; `redis_connected()` and the
  `parity_<service>_redis_connected` gauge are 0 during the outage and 1 after; the first command after the
  restart succeeds within 10 s.
- `test_trainer_*`: a real trainer service mid-run goes NOT_SERVING while Redis is down, SERVING
  within 10 s of its return, and finishes its 12 steps with every rollout trained exactly once
  (its lineage) and a metrics row per step.
- `test_actor_*`: a rollout service with its actor (reference engine) goes NOT_SERVING during the
  outage and keeps publishing after it; then a crashed actor loop (the stream key replaced by a
  string: XADD fails with WRONGTYPE) turns it NOT_SERVING, and it restarts and publishes again once
  the key is fixed.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from parity import health
from parity.procs import ServiceProcess, start_redis, stop_groups
from parity.rollout_queue import RolloutQueue, connection_gauge, redis_connected
from parity.v1 import rollouts_pb2, trainer_pb2_grpc
from tests.fakes.synthetic_rollouts import make_group
from tests.service_exit import exit_code
from tests.test_trainer_service import lineage, status, trainer_args, wait_for

RECOVERY_S = 10.0


@pytest.fixture(scope="module")
def groups(tiny_model: Path) -> list:
    import torch

    from trainer.policy import load_model

    model = load_model(tiny_model)
    gen = torch.Generator().manual_seed(0)
    rewards = [(1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 1.0)]
    return [
        make_group(model, f"o{i:02d}", rewards[i % 3], generator=gen, sample=False, completion_len=6)
        for i in range(12)
    ]


def _password(url: str) -> str:
    return url.split("://:", 1)[1].split("@", 1)[0]


def _kill(server: ServiceProcess) -> None:
    server.signal(signal.SIGKILL)
    server.proc.wait(10)


def _serving(address: str) -> bool:
    return health.check(address, timeout_s=2.0, wait_for_ready=False)[0]


def _wait_health(address: str, serving: bool, timeout_s: float) -> float:
    """Seconds until health is `serving`; fails after `timeout_s`."""
    started = time.monotonic()
    while _serving(address) != serving:
        assert time.monotonic() - started < timeout_s, f"health never became {serving} in {timeout_s}s"
        time.sleep(0.1)
    return time.monotonic() - started


def test_queue_waits_out_a_kill_9(tmp_path: Path) -> None:
    server, url = start_redis(tmp_path)
    gauge = connection_gauge("parity_test_redis_connected")
    queue = RolloutQueue(url, stream="outage")
    consumer_queue = RolloutQueue(url, stream="outage")
    published: list[str] = []
    consumed: list[str] = []
    done = threading.Event()

    def produce() -> None:
        for i in range(40):
            group = rollouts_pb2.RolloutGroup(group_id=f"g{i:02d}")
            queue.publish(group)
            published.append(group.group_id)
            time.sleep(0.05)
        done.set()

    def consume() -> None:
        while not done.is_set() or len(consumed) < len(published):
            for entry in consumer_queue.read("c0", count=8, block_ms=200, claim_idle_ms=60_000):
                consumed.append(entry.group.group_id)
                consumer_queue.ack([entry.entry_id])

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(published) >= 10, 30, "10 published")
        _kill(server)
        wait_for(lambda: redis_connected() is False, 10, "the outage noticed")
        assert gauge._value.get() == 0.0
        during = len(published)
        time.sleep(1.5)
        assert len(published) <= during + 1  # the producer waits (at most one XADD was in flight)
        server, _ = start_redis(tmp_path, password=_password(url), port=server.port)
        restarted = time.monotonic()
        wait_for(lambda: len(published) > during + 1, RECOVERY_S, "a publish after the restart")
        recovered_s = time.monotonic() - restarted
        for thread in threads:
            thread.join(60)
        assert recovered_s < RECOVERY_S
        assert redis_connected() is True and gauge._value.get() == 1.0
        assert sorted(set(consumed)) == sorted(published)  # nothing lost
        assert len(set(consumed)) == 40
    finally:
        stop_groups([server], grace_s=5.0)


@pytest.mark.slow
def test_trainer_waits_out_a_kill_9_and_trains_every_rollout_once(
    tmp_path: Path, start_services, groups: list
) -> None:
    server, url = start_redis(tmp_path / "redis")
    try:
        run_dir = tmp_path / "run"
        args = trainer_args(url, run_dir, "--steps", "12", "--checkpoint_every", "3")
        queue = RolloutQueue(url, stream="svc:rollouts")
        for g in groups[:4]:
            queue.publish(g)
        svc = start_services("trainer", *args)
        with grpc.insecure_channel(svc.address) as chan:
            stub = trainer_pb2_grpc.TrainerServiceStub(chan)
            wait_for(lambda: status(stub).step == 4, what="step 4")
            _kill(server)
            _wait_health(svc.address, serving=False, timeout_s=10.0)
            time.sleep(2.0)
            assert svc.alive(), svc.log_tail()
            server, _ = start_redis(tmp_path / "redis", password=_password(url), port=server.port)
            recovered_s = _wait_health(svc.address, serving=True, timeout_s=RECOVERY_S)
            for g in groups[4:]:
                queue.publish(g)
        assert exit_code(svc, 180) == 0, svc.log_tail()
        assert recovered_s < RECOVERY_S
        expected = sorted(s.rollout_id for g in groups for s in g.samples)
        assert sorted(lineage(run_dir)) == expected  # 0 lost, 0 trained twice
        assert "redis unreachable" in svc.log_path.read_text()
    finally:
        stop_groups([server], grace_s=5.0)


@pytest.mark.slow
def test_actor_waits_out_a_kill_9_and_restarts_after_a_crash(
    tmp_path: Path, start_services, tiny_model: Path
) -> None:
    import redis

    server, url = start_redis(tmp_path / "redis")
    stream = "actor:outage"
    try:
        svc = start_services(
            "rollout", "--engine", "reference", "--model", str(tiny_model), "--actor", "true",
            "--redis_url", url, "--stream", stream, "--group_size", "2", "--max_tokens", "4",
            "--max_lag", "1000", "--skip_zero_variance", "false", "--concurrency", "2",
        )  # fmt: skip
        client = redis.Redis.from_url(url)
        wait_for(lambda: client.xlen(stream) >= 3, 60, "3 groups published")
        _kill(server)
        _wait_health(svc.address, serving=False, timeout_s=10.0)
        server, _ = start_redis(tmp_path / "redis", password=_password(url), port=server.port)
        recovered_s = _wait_health(svc.address, serving=True, timeout_s=RECOVERY_S)
        client = redis.Redis.from_url(url)
        before = client.xlen(stream)
        wait_for(lambda: client.xlen(stream) > before + 2, 60, "publishing after the restart")
        assert recovered_s < RECOVERY_S
        # A crash of the actor loop: the stream key becomes a string, so XADD fails (WRONGTYPE).
        client.delete(stream)
        client.set(stream, "not a stream")
        _wait_health(svc.address, serving=False, timeout_s=30.0)
        client.delete(stream)
        _wait_health(svc.address, serving=True, timeout_s=60.0)
        wait_for(lambda: client.exists(stream) and client.xlen(stream) >= 2, 60, "publishing after the crash")
        log = svc.log_path.read_text()
        assert "actor loop crashed" in log and "restarting in" in log
        assert svc.alive()
    finally:
        stop_groups([server], grace_s=5.0)


def test_a_redis_gone_silent_is_an_outage_not_a_read_that_never_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts and never answers (a partition, a paused host): every command has a
    reply deadline, so it is retried as an outage and ends with the outage's error, instead of
    blocking forever (redis-py before 8 sets no read timeout of its own)."""
    import socket

    import redis

    from parity import rollout_queue

    monkeypatch.setattr(rollout_queue, "SOCKET_TIMEOUT_S", 0.5)
    monkeypatch.setattr(rollout_queue, "FIRST_CONNECT_TIMEOUT_S", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        client = rollout_queue.connect(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.5 and kwargs["socket_keepalive"] is True
        start = time.monotonic()
        with pytest.raises(redis.ConnectionError, match="redis unreachable"):
            client.ping()
        assert time.monotonic() - start < 60
    finally:
        silent.close()
