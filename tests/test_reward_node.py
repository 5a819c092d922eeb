"""The Node.js RewardService (clients/node/reward_server.js) answers Parity's reward client over real
gRPC on loopback. Without node these tests FAIL (issue 18: CI installs node); they never skip.
Training with it as the reward is tests/test_byo_task_run.py (the gsm8k_mini run)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from parity.config.task import TaskConfig
from parity.v1 import reward_pb2, reward_pb2_grpc
from rollout.rewards import build_scorer
from rollout.tasks import Prompt, get_task
from tests.reward_helpers import start_node_reward_server


@pytest.fixture(scope="module")
def node_reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, address = start_node_reward_server(tmp_path_factory.mktemp("node") / "port")
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


def test_node_reward_scores_a_batch_through_the_parity_client(node_reward: str) -> None:
    scorer = build_scorer(get_task("arithmetic"), TaskConfig(reward=f"grpc:{node_reward}"))
    prompt = Prompt("q1", "Tom has 1,200 cards and buys 34. How many?", "1234", metadata={"grade": 3})
    completions = ["1,234", "He has 1200 + 34 = 1234 cards.", "1233", "none", "1234.0"]
    assert asyncio.run(scorer.score(prompt, completions, "g1")) == [1.0, 1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("items", "details"),
    [
        ([], "items: at least one item is required"),
        ([reward_pb2.ScoreItem(completion="3", answer="3"), reward_pb2.ScoreItem(completion="3", answer="three")],
         'items[1].answer: not a number ("three")'),
    ],
)  # fmt: skip
def test_node_reward_rejects_bad_input_naming_the_field(node_reward: str, items: list, details: str) -> None:
    with grpc.insecure_channel(node_reward) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Score(reward_pb2.ScoreRequest(items=items), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == details


def test_node_reward_binds_loopback_and_answers_health(node_reward: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert node_reward.startswith("127.0.0.1:")
    with grpc.insecure_channel(node_reward) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_node_reward_server_is_the_one_documented() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "tasks.md").read_text()
    assert "clients/node/reward_server.js" in docs
