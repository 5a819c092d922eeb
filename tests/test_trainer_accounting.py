"""Honest accounting in the trainer (issue #20), in-process on the tiny model and a real Redis:

- a step whose gradient is not finite takes no optimizer step; its rollouts are acknowledged but
  recorded as skipped (skipped_rollouts.jsonl), never as trained, and counted in metrics.jsonl;
- `trainer.max_nonfinite_steps` such steps in a row stop the run with an error naming the field;
- a failed weight transfer is retried with backoff against a real broadcast service;
- an XADD retried after its reply was lost lands twice in the stream, and is trained once.

The non-finite gradient comes from a test hook (tests/fakes/gradient_faults.py), the lost reply
from a proxy in front of the real redis-server (tests/fakes/reply_dropping_proxy.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import torch

from parity.rollout_queue import RolloutQueue
from parity.weights.sender import Publisher, PublishError
from tests.fakes.gradient_faults import NanGradients
from tests.fakes.reply_dropping_proxy import ReplyDroppingProxy
from tests.fakes.synthetic_rollouts import make_group
from tests.fakes.trainer_helpers import STREAM, make_trainer, metrics
from trainer.nonfinite import SKIPPED_ROLLOUTS_FILE, NonFiniteStepsError
from trainer.policy import load_model
from trainer.weight_history import full_weights


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path):
    return load_model(tiny_model)


def group(model, gid: str, seed: int = 0):
    return make_group(model, gid, (1.0, 0.0, 0.0, 1.0), generator=torch.Generator().manual_seed(seed))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trained_ids(run_dir: Path) -> list[str]:
    return [rid for row in lines(run_dir / "trained_rollouts.jsonl") for rid in row["rollout_ids"]]


def ids_of(gid: str) -> list[str]:
    return [f"{gid}/{i}" for i in range(4)]


def test_a_nonfinite_gradient_skips_the_step_and_records_its_rollouts(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    for i in range(3):
        queue.publish(group(reference_model, f"g{i}", seed=i))
    trainer = make_trainer(redis_url, tmp_path, steps=3, max_nonfinite_steps=2, max_lag=8)
    fault = NanGradients(trainer, steps={1, 3})  # never two in a row: the run goes on
    trainer.run()
    assert fault.poisoned_steps == {1, 3}
    rows = metrics(tmp_path)
    assert [r["skipped_nonfinite"] for r in rows] == [1, 0, 1]
    assert [r["skipped_nonfinite_steps_total"] for r in rows] == [1, 1, 2]
    assert [r["rollouts_skipped_nonfinite"] for r in rows] == [4, 0, 4]
    assert rows[0]["grad_norm"] is None  # NaN in metrics.jsonl is null, never a number
    backlog = [r["backlog"] for r in rows]  # entries not yet acked, read at each step
    print("backlog per step:", backlog)
    assert backlog == sorted(backlog, reverse=True) and backlog[0] >= 2 and backlog[-1] >= 0
    # skipped rollouts are not in the lineage (trained once or never), but recorded as skipped
    assert trained_ids(tmp_path) == ids_of("g1")
    skipped = lines(tmp_path / SKIPPED_ROLLOUTS_FILE)
    assert [(r["step"], r["reason"], r["rollout_ids"]) for r in skipped] == [
        (1, "nonfinite_gradient", ids_of("g0")),
        (3, "nonfinite_gradient", ids_of("g2")),
    ]
    assert trainer.applied_ids == set(ids_of("g1"))
    state = trainer.state
    assert (state.rollouts_trained_total, state.skipped_nonfinite_steps_total) == (4, 2)
    assert state.rollouts_skipped_nonfinite_total == 8
    assert all(float(s["step"]) == 1 for s in trainer.optimizer.state.values())  # one real step
    assert queue.backlog() == 0  # acknowledged: dropped, not redelivered


def test_nonfinite_steps_in_a_row_stop_the_run(redis_url: str, tmp_path: Path, reference_model) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    for i in range(3):
        queue.publish(group(reference_model, f"h{i}", seed=i))
    trainer = make_trainer(redis_url, tmp_path, steps=3, max_nonfinite_steps=2)
    NanGradients(trainer, steps={1, 2, 3})
    with pytest.raises(NonFiniteStepsError, match=r"2 steps in a row .*trainer\.max_nonfinite_steps=2"):
        trainer.run()
    assert trainer.state.step == 2 and trainer.state.rollouts_trained_total == 0
    assert [r["step"] for r in lines(tmp_path / SKIPPED_ROLLOUTS_FILE)] == [1, 2]
    assert queue.backlog() == 1  # the third group was never taken


def test_a_retried_xadd_lands_twice_and_is_trained_once(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    import redis

    parts = urlsplit(redis_url)
    proxy = ReplyDroppingProxy(parts.hostname, parts.port)
    netloc = parts.netloc.rsplit(":", 1)[0].rsplit("@", 1)
    netloc = f"{netloc[0]}@127.0.0.1:{proxy.port}" if len(netloc) == 2 else f"127.0.0.1:{proxy.port}"
    producer = RolloutQueue(urlunsplit(parts._replace(netloc=netloc)), stream=STREAM)
    proxy.drop_reply_to(b"XADD")
    producer.publish(group(reference_model, "x0"))  # the reply is lost; the client sends it again
    producer.publish(group(reference_model, "x1", seed=1))
    assert proxy.dropped == 1
    entries = redis.Redis.from_url(redis_url).xrange(STREAM)
    assert [e[1][b"group_id"] for e in entries] == [b"x0", b"x0", b"x1"]  # the duplicate landed
    trainer = make_trainer(redis_url, tmp_path, steps=2)
    trainer.run()
    assert sorted(trained_ids(tmp_path)) == sorted(ids_of("x0") + ids_of("x1"))  # each exactly once
    assert trainer.state.duplicates_skipped_total == 1
    assert RolloutQueue(redis_url, stream=STREAM).backlog() == 0
    proxy.close()


@pytest.mark.slow
def test_a_failed_transfer_is_retried_with_backoff(start_services, tmp_path: Path, reference_model) -> None:
    """A worker that registers but never joins the data group fails version 1's transfer; the
    broadcast service excludes it and the trainer's retry publishes version 1 again."""
    token = "accounting-token"
    broadcast = start_services(
        "broadcast", "--auth_token", token, "--transfer_timeout_s", "3", "--retry_failed_after_s", "600"
    )
    port_file = tmp_path / "ghost.port"
    cmd = [sys.executable, "-m", "tests.fakes.fake_receiver", "--broadcast_address", broadcast.address,
           "--worker_id", "ghost", "--port_file", str(port_file), "--never_join"]  # fmt: skip
    env = {"PARITY_AUTH_TOKEN": token, **_environ()}
    with open(tmp_path / "ghost.log", "ab") as log:
        ghost = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    publisher = Publisher(broadcast.address, "tiny", auth_token=token, wait_committed_s=5)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert time.monotonic() < deadline and ghost.poll() is None, "stand-in worker did not start"
            time.sleep(0.1)
        started = time.monotonic()
        result = publisher.publish_retrying(
            lambda: full_weights(reference_model, publisher.bucket_bytes), 1, attempts=3, backoff_s=0.2
        )
        assert (result.version, result.committed) == (1, True)
        assert publisher.publish_retries_total == 1  # attempt 1 failed (the ghost), attempt 2 committed
    finally:
        publisher.close()
        ghost.kill()
        ghost.wait(10)
    assert time.monotonic() - started < 30


def test_publish_gives_up_after_its_attempts_naming_each(reference_model) -> None:
    from parity.ports import free_port

    publisher = Publisher(f"127.0.0.1:{free_port()}", "tiny", rpc_timeout_s=0.5)  # nobody listens
    try:
        with pytest.raises(PublishError, match=r"gave up after 2 attempt\(s\): attempt 1: .*; attempt 2: "):
            publisher.publish_retrying(
                lambda: full_weights(reference_model, publisher.bucket_bytes), 1, attempts=2, backoff_s=0.05
            )
        assert publisher.publish_retries_total == 1
    finally:
        publisher.close()


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_a_step_that_trained_nothing_has_no_gradient_norm_not_zero() -> None:
    """Every group flat (one reward for all its samples) and no KL: nothing is trained, so there is
    no gradient norm to report; 0.0 would read as "trained, gradient vanished"."""
    import math

    from trainer.step import optimizer_step

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    idle = optimizer_step(layer, optimizer, scheduler, 1.0, trainable_tokens=0)
    assert math.isnan(idle.grad_norm) and not idle.stepped
    layer(torch.ones(1, 3)).sum().backward()
    trained = optimizer_step(layer, optimizer, scheduler, 1.0, trainable_tokens=1)
    assert trained.stepped and math.isfinite(trained.grad_norm) and trained.grad_norm > 0
