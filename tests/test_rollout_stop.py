"""A vLLM rollout service stops cleanly the way every launcher stops it: SIGTERM to its process group.

`parity.procs.stop_groups` (parity run, the tests' `start_services`) signals the whole group, so
vLLM's worker gets SIGTERM at the moment its engine core does. vLLM's worker exits on it at once;
an engine core waiting for that worker's step then took the loss for a crash and logged "EngineCore
encountered a fatal error" with a dump of its scheduler, at the end of a clean run. The worker now
lets the first SIGTERM pass and is ended by its engine core (rollout/worker_extension.py).

The race is made certain here: requests are decoding, the worker is frozen (SIGSTOP) so that the
engine core waits for its step, the group gets SIGTERM, then the worker resumes with the signal
pending. The service must exit 0 within seconds, every request must get an answer, the log must
hold no error, and no engine process may be left.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.test_engine_recovery import vllm_processes
from tests.test_launcher import ERROR_LINE

pytestmark = pytest.mark.slow


def test_a_group_sigterm_while_the_worker_is_mid_step_stops_the_service_cleanly(
    start_services, tiny_model: Path
) -> None:
    svc = start_services("rollout", "--model", str(tiny_model), "--engine", "vllm", "--max_model_len", "512")
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(svc.address))
    engines = {p.name(): p for p in vllm_processes(svc.proc.pid)}
    assert set(engines) == {"VLLM::EngineCore", "VLLM::Worker"}, engines
    worker = engines["VLLM::Worker"]
    answers: list[object] = []

    def long_generate() -> None:
        request = rollout_pb2.GenerateRequest(
            prompt_token_ids=list(range(10, 30)),
            sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=480, n=4, ignore_eos=True),
        )
        try:
            answers.append(stub.Generate(request, timeout=120))
        except grpc.RpcError as exc:
            answers.append(exc)

    clients = [threading.Thread(target=long_generate) for _ in range(2)]
    try:
        for client in clients:
            client.start()
        deadline = time.monotonic() + 60
        while (
            stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10).num_running_requests < 2
        ):
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.02)
        worker.send_signal(signal.SIGSTOP)  # mid-decode: the engine core now waits for this step
        time.sleep(0.5)
        stopped = time.monotonic()
        os.killpg(svc.proc.pid, signal.SIGTERM)
        time.sleep(0.5)  # the engine core and the service act on theirs; the worker's is pending
        worker.send_signal(signal.SIGCONT)
        assert svc.proc.wait(30) == 0, svc.log_tail()
        took = time.monotonic() - stopped
        for client in clients:
            client.join(30)
        assert len(answers) == 2, answers  # an answer each, no hang
        for answer in answers:
            assert not isinstance(answer, grpc.RpcError) or answer.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
            ), answer
        _, alive = psutil.wait_procs(list(engines.values()), timeout=15)
        assert alive == [], f"left behind: {alive}"
        log = svc.log_path.read_text(errors="replace")
        bad = [line[:300] for line in log.splitlines() if ERROR_LINE.search(line)]
        assert bad == [], "\n".join(bad[:20])
        print(f"stopped in {took:.1f}s")
    finally:
        for proc in engines.values():
            try:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            except psutil.NoSuchProcess:
                pass
