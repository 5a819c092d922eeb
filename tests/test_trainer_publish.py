"""The trainer publishes through the real weight-broadcast service: one version per publish, the
broadcast commits them with the trainer's checksums, and a trainer that restarts behind the
broadcast's latest version continues above it (versions never reused)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from parity.rollout_queue import RolloutQueue
from parity.server import bearer
from parity.v1 import broadcast_pb2, broadcast_pb2_grpc
from tests.conftest import config_for
from tests.fakes.synthetic_rollouts import make_group
from trainer.loop import Trainer
from trainer.policy import load_model

TOKEN = "tok"
STREAM = "pub:rollouts"


def run_trainer(redis_url: str, run_dir: Path, broadcast: str, steps: int) -> Trainer:
    config = config_for(
        "trainer",
        model="tiny",
        redis_url=redis_url,
        stream=STREAM,
        run_dir=str(run_dir),
        steps=steps,
        groups_per_step=1,
        read_block_ms=50,
        broadcast_address=broadcast,
        max_lag=10,
        lr=1e-3,
        wait_committed_s=20,
    )
    trainer = Trainer(
        config.model_copy(update={"trainer": config.trainer.model_copy(update={"auth_token": TOKEN})})
    )
    trainer.setup()
    trainer.run()
    trainer.close()
    return trainer


@pytest.mark.slow
def test_versions_are_published_committed_and_continue_above_the_broadcasts_latest(
    redis_url: str, tmp_path: Path, start_services, tiny_model: Path
) -> None:
    broadcast = start_services(
        "broadcast", "--auth_token", TOKEN, "--transfer_timeout_s", "20", timeout_s=240
    )
    model = load_model(tiny_model)
    queue = RolloutQueue(redis_url, stream=STREAM)
    gen = torch.Generator().manual_seed(0)
    for i in range(2):
        queue.publish(make_group(model, f"g{i}", (1.0, 0.0, 0.0, 0.0), generator=gen))
    first = run_trainer(redis_url, tmp_path / "a", broadcast.address, steps=2)
    assert first.state.weight_version == 2
    with grpc.insecure_channel(broadcast.address) as chan:
        stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
        reply = stub.WaitVersion(
            broadcast_pb2.WaitVersionRequest(
                version=2, state=broadcast_pb2.VERSION_STATE_COMMITTED, timeout_s=10
            ),
            timeout=20,
            metadata=bearer(TOKEN),
        )
        assert reply.reached and reply.version.num_tensors == len(list(first.model.named_parameters()))
        status = stub.GetStatus(broadcast_pb2.WeightBroadcastServiceGetStatusRequest(), timeout=5)
        assert status.latest_version == 2
        committed = {v.version for v in status.versions if v.state >= broadcast_pb2.VERSION_STATE_COMMITTED}
        assert {1, 2} <= committed
        # A fresh trainer (no checkpoint: it starts from version 0's weights) must not reuse 1 or 2.
        queue.publish(make_group(model, "g2", (1.0, 0.0, 0.0, 0.0), generator=gen))
        second = run_trainer(redis_url, tmp_path / "b", broadcast.address, steps=1)
        assert second.state.weight_version == 4  # 3 = re-published initial weights, 4 = after its step
        assert (
            stub.GetStatus(broadcast_pb2.WeightBroadcastServiceGetStatusRequest(), timeout=5).latest_version
            == 4
        )


def test_a_catch_up_that_raises_does_not_end_the_catch_ups() -> None:
    """An error other than a failed transfer (an OOM staging the version, a CUDA error) used to end
    the catch-up thread for good: workers behind then waited forever, and so did a trainer waiting
    for their rollouts. The thread logs it and goes on; the next catch-up is sent."""
    import threading

    from parity.v1 import common_pb2
    from parity.weights.sender import Publisher

    class FakeBroadcast:  # a fake: AwaitCatchUp always asks for the version held
        def AwaitCatchUp(self, request, timeout, metadata):
            plan = common_pb2.TransferPlan(version=request.have_version)
            return broadcast_pb2.AwaitCatchUpResponse(plan=plan)

    publisher = Publisher("127.0.0.1:1", "tiny", auth_token=TOKEN)
    publisher._stub = FakeBroadcast()
    calls, second = [], threading.Event()

    def send(plan, snapshot, ipc_workers=0):
        calls.append(plan.version)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (injected)")
        second.set()

    publisher._send_catch_up = send
    try:
        publisher.serve_catch_up(3, [("w", torch.zeros(2))])
        assert second.wait(30), calls
        assert calls[:2] == [3, 3] and publisher.catch_up_failures == 1
    finally:
        publisher.close()
