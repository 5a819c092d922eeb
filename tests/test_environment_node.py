"""The Node.js EnvironmentService (clients/node/env_server.js) plays whole episodes through Parity's
`env:grpc:HOST:PORT` client over real gRPC on loopback. Without node these tests FAIL (CI installs
node); they never skip."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest

from parity.v1 import environment_pb2, environment_pb2_grpc
from rollout.environments import EnvironmentFailed, StepResult, get_environment
from rollout.environments.remote import to_struct
from tests.reward_helpers import NODE_DIR, ROOT

TOKEN = "node-env-token"


def start_env_server(token: str = "") -> tuple[subprocess.Popen, str]:
    """env_server.js on a free loopback port (--port 0; the port is read from its stdout)."""
    node = shutil.which("node")
    assert node is not None, (
        "node is not installed (apt-get install nodejs npm); the Node environment test needs it"
    )
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "clients/node/node_modules is missing: run `bash scripts/setup.sh` (it runs npm install)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PARITY_AUTH_TOKEN"}
    proc = subprocess.Popen(
        [node, str(NODE_DIR / "env_server.js"), "--port", "0"],
        cwd=ROOT,
        env={**env, "PARITY_AUTH_TOKEN": token} if token else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the server prints its port or exits
    match = re.fullmatch(r"env_server: EnvironmentService serving on 127\.0\.0\.1:(\d+)\n", line)
    assert match, f"env_server.js did not report its port: {line!r} (exit {proc.poll()}) {proc.stdout.read()}"
    return proc, f"127.0.0.1:{match.group(1)}"


@pytest.fixture(scope="module")
def node_env() -> Iterator[str]:
    proc, address = start_env_server(TOKEN)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def with_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARITY_AUTH_TOKEN", TOKEN)


async def binary_search(source, record: dict, episode_id: str) -> tuple[str, list[StepResult]]:
    env = source.new_episode(episode_id)
    try:
        first = await env.reset(record)
        low, high, results = 1, int(record["high"]), []
        while not results or not results[-1].done:
            guess = (low + high) // 2
            results.append(await env.step(f"I guess {guess}"))
            low, high = (
                (guess + 1, high) if results[-1].observation.startswith("Higher") else (low, guess - 1)
            )
        return first, results
    finally:
        await env.close()


def test_node_environment_plays_full_episodes_through_remote_env(node_env: str, with_token: None) -> None:
    source = get_environment(f"env:grpc:{node_env}", seed=5)
    held_out = source.eval_records(1000)
    assert len(held_out) >= 20 and len({r["id"] for r in held_out}) == len(held_out)
    assert all(isinstance(r["secret"], int) for r in held_out)  # whole numbers come back as ints
    train = list(itertools.islice(source.train_records(), 600))  # three pages
    assert train == list(itertools.islice(source.train_records(5), 600))
    assert not {r["id"] for r in train} & {r["id"] for r in held_out}

    async def play_all() -> list[tuple[str, list[StepResult]]]:
        return await asyncio.gather(
            *(binary_search(source, r, f"ep-{i}") for i, r in enumerate(held_out[:8]))
        )

    for record, (first, results) in zip(held_out, asyncio.run(play_all()), strict=False):
        assert first.startswith(f"I am thinking of a whole number between 1 and {record['high']}.")
        assert results[-1].observation == f"Correct! The number was {record['secret']}."
        guesses = len(results)
        assert guesses <= record["max_guesses"]
        assert results[-1].reward == 1 - 0.5 * (guesses - 1) / record["max_guesses"]
        assert all(r.reward == 0.0 and not r.done for r in results[:-1])
    asyncio.run(source.close())


def test_node_environment_loses_a_game_out_of_guesses(node_env: str, with_token: None) -> None:
    source = get_environment(f"env:grpc:{node_env}")
    record = {"id": "guess-16-11", "high": 16, "secret": 11, "max_guesses": 3}

    async def play() -> list[StepResult]:
        env = source.new_episode("lose")
        await env.reset(record)
        results = [await env.step(a) for a in ("8", "no idea", "13")]
        await env.close()
        return results

    assert asyncio.run(play()) == [
        StepResult("Higher. 2 guesses left.", 0.0, False),
        StepResult("Reply with one number between 1 and 16. 1 guess left.", 0.0, False),
        StepResult("Out of guesses: the number was 11.", 0.0, True),
    ]


def test_node_environment_answers_a_repeated_step_index_without_stepping_twice(node_env: str) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    record = to_struct({"id": "guess-16-11", "high": 16, "secret": 11, "max_guesses": 5})
    with grpc.insecure_channel(node_env) as channel:
        stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
        stub.Reset(
            environment_pb2.ResetRequest(episode_id="retry", record=record), timeout=10, metadata=metadata
        )
        step = environment_pb2.StepRequest(episode_id="retry", step_index=0, action="8")
        first = stub.Step(step, timeout=10, metadata=metadata)
        again = stub.Step(step, timeout=10, metadata=metadata)  # a retry: same reply, same guesses left
        assert first == again and first.observation == "Higher. 4 guesses left."
        second = stub.Step(
            environment_pb2.StepRequest(episode_id="retry", step_index=1, action="12"),
            timeout=10,
            metadata=metadata,
        )
        assert second.observation == "Lower. 3 guesses left."
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(
                environment_pb2.StepRequest(episode_id="retry", step_index=5, action="1"),
                timeout=10,
                metadata=metadata,
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details() == "step_index: expected 2, got 5"
        stub.Close(environment_pb2.CloseRequest(episode_id="retry"), timeout=10, metadata=metadata)
        stub.Close(
            environment_pb2.CloseRequest(episode_id="retry"), timeout=10, metadata=metadata
        )  # idempotent


def test_node_environment_refuses_calls_without_the_token(
    node_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PARITY_AUTH_TOKEN", raising=False)
    source = get_environment(f"env:grpc:{node_env}")
    started = time.monotonic()
    with pytest.raises(EnvironmentFailed) as info:
        asyncio.run(
            source.new_episode("no-token").reset(
                {"id": "guess-8-1", "high": 8, "secret": 1, "max_guesses": 4}
            )
        )
    assert info.value.reason == "error" and time.monotonic() - started < 5  # not retried
    assert "reset: UNAUTHENTICATED: authorization: needs 'Bearer <token>' metadata (attempt 1)" in str(
        info.value
    )


def test_node_environment_names_the_bad_record_field(node_env: str, with_token: None) -> None:
    source = get_environment(f"env:grpc:{node_env}")
    with pytest.raises(EnvironmentFailed) as info:
        asyncio.run(source.new_episode("bad").reset({"id": "x", "high": 8, "secret": 9, "max_guesses": 4}))
    assert info.value.reason == "error"
    assert str(info.value).endswith(
        "episode bad: reset: INVALID_ARGUMENT: record.secret: expected an integer in 1..8, got 9 (attempt 1)"
    )


def test_node_environment_binds_loopback_and_answers_health(node_env: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert node_env.startswith("127.0.0.1:")
    with grpc.insecure_channel(node_env) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_node_environment_runs_without_a_token_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARITY_AUTH_TOKEN", raising=False)
    proc, address = start_env_server()
    try:
        source = get_environment(f"env:grpc:{address}")
        record = source.eval_records(1)[0]
        _, results = asyncio.run(binary_search(source, record, "open"))
        assert results[-1].done and results[-1].reward > 0.5
    finally:
        proc.terminate()
        proc.wait(10)
