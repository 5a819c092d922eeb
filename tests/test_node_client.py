"""The Node.js client (clients/node/generate.js) talks to Parity's gRPC API without Python.

First against a small Python stand-in RolloutService (named as such: it proves the client's
encoding, health check and error handling with exact expected values), then against the real
rollout service on the tiny model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
CLIENT_DIR = ROOT / "clients" / "node"
NODE = shutil.which("node")


@pytest.fixture(autouse=True)
def node_installed() -> None:
    """CI installs node: on a host without it these tests fail with this line, never skip."""
    if NODE is None:
        pytest.fail("node is not installed (apt-get install nodejs npm): the Node client tests need it")


def run_client(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run `bash scripts/setup.sh` (it runs npm install)")
    return subprocess.run(
        [NODE, str(CLIENT_DIR / "generate.js"), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )


class StandInRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """A stand-in RolloutService returning fixed completions; records the requests it saw."""

    def __init__(self) -> None:
        self.requests: list[rollout_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if request.sampling.n > 4:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.n: must be <= 4 (max_n), got 9")
        completions = [
            rollout_pb2.Completion(
                index=i,
                token_ids=[10 + i, 20 + i, 30 + i],
                logprobs=[-0.5, -1.25, -2.0 - i],
                token_weight_versions=[3, 3, 4_000_000_000 + i],
                text=f"c{i}",
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
            )
            for i in range(max(1, request.sampling.n))
        ]
        return rollout_pb2.GenerateResponse(
            request_id=request.request_id,
            prompt_token_ids=[1, 2, 3],
            completions=completions,
            logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED,
        )


@pytest.fixture(scope="module")
def stand_in() -> Iterator[tuple[str, StandInRollout, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = StandInRollout()
    health_servicer = health.HealthServicer()
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", servicer, health_servicer
    server.stop(0)


def test_node_client_prints_tokens_logprobs_versions_from_stand_in(stand_in) -> None:
    address, servicer, _ = stand_in
    done = run_client(
        "--address", address, "--prompt", "What is 2+2?", "--n", "2", "--max_tokens", "3",
        "--temperature", "0.7", "--top_k", "5", "--seed", "11", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    request = servicer.requests[-1]
    assert request.prompt_text == "What is 2+2?"
    assert (request.sampling.n, request.sampling.max_tokens, request.sampling.top_k) == (2, 3, 5)
    assert request.sampling.temperature == pytest.approx(0.7)
    assert request.sampling.seed == 11
    assert result["health"] == "SERVING"
    assert result["logprobs_mode"] == "LOGPROBS_MODE_PROCESSED"
    assert result["request_id"] == request.request_id and request.request_id.startswith("node-")
    assert result["prompt_token_ids"] == [1, 2, 3]
    assert [c["token_ids"] for c in result["completions"]] == [[10, 20, 30], [11, 21, 31]]
    assert result["completions"][1]["logprobs"] == [-0.5, -1.25, -3.0]
    # int64 versions above 2**32 survive the trip (proto-loader longs: Number).
    assert result["completions"][1]["token_weight_versions"] == [3, 3, 4_000_000_001]
    assert result["completions"][0]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_node_client_text_output_lists_every_token(stand_in) -> None:
    address, _, _ = stand_in
    done = run_client("--address", address, "--prompt_token_ids", "5,6", "--n", "1")
    assert done.returncode == 0, done.stderr
    assert "LOGPROBS_MODE_PROCESSED" in done.stdout
    rows = [
        line.split() for line in done.stdout.splitlines() if line.startswith("  ") and "token" not in line
    ]
    assert rows == [["10", "-0.5000", "3"], ["20", "-1.2500", "3"], ["30", "-2.0000", "4000000000"]]


def test_node_client_reports_grpc_errors_and_health(stand_in) -> None:
    address, _, health_servicer = stand_in
    rejected = run_client("--address", address, "--n", "9")
    assert rejected.returncode == 1
    assert "INVALID_ARGUMENT" in rejected.stderr and "sampling.n" in rejected.stderr
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        not_serving = run_client("--address", address)
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stderr
    bad_args = run_client("--address", address, "--n", "-1")
    assert bad_args.returncode == 2 and "--n" in bad_args.stderr
    unreachable = run_client("--address", "127.0.0.1:1", "--timeout_s", "1")
    assert unreachable.returncode == 1 and (
        "UNAVAILABLE" in unreachable.stderr or "DEADLINE" in unreachable.stderr
    )


@pytest.mark.slow
def test_node_client_generates_on_real_rollout_service(start_services, tiny_model) -> None:
    """A real rollout service on the tiny model: tokens, processed logprobs, version 0. The client is
    what is tested, so the service runs the reference engine (it starts in a fifth of vLLM's time)."""
    rollout = start_services("rollout", "--model", "tiny", "--max_model_len", "512", "--engine", "reference")
    done = run_client(
        "--address", rollout.address, "--prompt", "What is 12+7?", "--n", "3", "--max_tokens", "8",
        "--temperature", "1.0", "--seed", "7", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + rollout.log_tail()
    result = json.loads(done.stdout)
    assert result["health"] == "SERVING"
    assert result["logprobs_mode"] == "LOGPROBS_MODE_PROCESSED"
    assert len(result["completions"]) == 3
    for completion in result["completions"]:
        tokens = completion["token_ids"]
        assert 1 <= len(tokens) <= 8
        assert all(0 <= t < 259 for t in tokens), "tiny model vocab is 259"
        assert len(completion["logprobs"]) == len(tokens)
        assert all(lp <= 0.0 for lp in completion["logprobs"])
        assert completion["token_weight_versions"] == [0] * len(tokens), "fresh service serves version 0"
