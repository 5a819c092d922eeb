"""A vLLM rollout service stops cleanly the way every launcher stops it: SIGTERM to its process group.

`parity.procs.stop_groups` (parity run, the tests' `start_services`) signals the whole group, so
vLLM's engine core (and, with `rollout.vllm_cpu_executor` "mp", its worker) gets SIGTERM at the
moment the service does. Two races follow, and both are made certain here by freezing the process
that computes the model (SIGSTOP) before the requests arrive:

- request A is in a step that is being computed. With a separate worker ("mp"), vLLM's worker exits
  on SIGTERM at once, and the engine core took the lost worker for a crash ("EngineCore encountered
  a fatal error" and a dump). The worker now lets the first SIGTERM pass
  (rollout/worker_extension.py). With the model in the engine core ("uni", the default on CPU),
  the engine core itself is frozen and gets its SIGTERM when it resumes;
- request B arrives while the engine core waits. On a fresh engine, AsyncLLM's first request asks
  the engine core for its supported tasks; a stopping engine core refuses that call with a bare
  Exception, which reached the client as INTERNAL. The engine therefore asks once when it starts.
  (A request that reaches the engine core after its last pass over its input queue is never
  answered: UNAVAILABLE, with vLLM's ERROR turned into INFO by rollout/vllm_stop_log.py; that race
  is rare here, so tests/test_vllm_stop_log.py checks the log filter itself.)

The service must exit 0 on its own (in 3-5 s on an idle box), every request must get an answer
(OK, UNAVAILABLE or CANCELLED), the log must hold no error, and no engine process may be left.

A stop while a weight update waits for a transfer group that never forms ends in seconds too: the
service no longer waits for the thread that waits for the group (parity.process_exit.serve_then_exit;
it waited out the rendezvous's timeout_s after logging that it had stopped).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.service_exit import exit_code
from tests.test_engine_recovery import vllm_processes
from tests.test_launcher import ERROR_LINE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("executor", "computes"), [("uni", "VLLM::EngineCore"), ("mp", "VLLM::Worker")]
)  # fmt: skip
def test_a_group_sigterm_while_the_model_is_mid_step_stops_the_service_cleanly(
    start_services, tiny_model: Path, executor: str, computes: str
) -> None:
    svc = start_services(
        "rollout", "--model", str(tiny_model), "--engine", "vllm", "--max_model_len", "512",
        "--vllm_cpu_executor", executor,
    )  # fmt: skip
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(svc.address))
    engines = {p.name(): p for p in vllm_processes(svc.proc.pid)}
    assert set(engines) == {"VLLM::EngineCore", computes}, engines
    worker = engines[computes]
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
        worker.send_signal(signal.SIGSTOP)  # the first step will wait for it
        for n, client in enumerate(clients, start=1):
            client.start()
            deadline = time.monotonic() + 60
            while (
                stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10).num_running_requests
                < n
            ):
                assert time.monotonic() < deadline, f"request {n} never ran"
                time.sleep(0.02)
            time.sleep(0.5)  # A: in the step the engine core waits for; B: in its input queue
        stopped = time.monotonic()
        os.killpg(svc.proc.pid, signal.SIGTERM)
        time.sleep(0.5)  # the running processes act on theirs; the frozen one's is pending
        worker.send_signal(signal.SIGCONT)
        assert exit_code(svc, 120) == 0, svc.log_tail()  # 3-5 s; 18-27 s on a box loaded 2.5x
        took = time.monotonic() - stopped
        for client in clients:
            client.join(30)
        log = svc.log_path.read_text(errors="replace")
        bad = "\n".join(line[:300] for line in log.splitlines() if ERROR_LINE.search(line))
        assert len(answers) == 2, answers  # an answer each, no hang
        for answer in answers:
            assert not isinstance(answer, grpc.RpcError) or answer.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
            ), f"{answer}\n{bad}"
        _, alive = psutil.wait_procs(list(engines.values()), timeout=15)
        assert alive == [], f"left behind: {alive}"
        assert bad == "", bad
        outcomes = [a.code().name if isinstance(a, grpc.RpcError) else "OK" for a in answers]
        print(f"stopped in {took:.1f}s; answers {outcomes}")
    finally:
        for proc in engines.values():
            try:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_stop_does_not_wait_out_an_update_whose_group_never_forms(start_services, tiny_model: Path) -> None:
    """SIGTERM while an UpdateWeights waits for a transfer group that never forms (its trainer
    gone): the service stops in seconds, not after the rendezvous's timeout_s (300 s here)."""
    from parity.ports import free_port
    from parity.server import bearer
    from parity.weights.rendezvous import group_store, serve_store
    from tests.fakes.rollout_helpers import transfer_plan
    from tests.test_broadcast_rollout import TOKEN, version_weights

    svc = start_services(
        "rollout", "--model", str(tiny_model), "--engine", "vllm", "--max_model_len", "512", "--auth_token", TOKEN
    )  # fmt: skip
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(svc.address))
    engines = vllm_processes(svc.proc.pid)
    plan, _sender, _ = transfer_plan(dict(version_weights(tiny_model, 1)), 1, timeout_s=300.0)
    plan.rendezvous.port = free_port()
    serve_store("127.0.0.1", plan.rendezvous.port)  # the store answers; rank 0 never comes
    answers: list[object] = []

    def update() -> None:
        try:
            answers.append(
                stub.UpdateWeights(
                    rollout_pb2.UpdateWeightsRequest(plan=plan), metadata=bearer(TOKEN), timeout=400
                )
            )
        except grpc.RpcError as exc:
            answers.append(exc)

    client = threading.Thread(target=update)
    client.start()
    arrived = group_store(plan.rendezvous)  # the service marks its rank, then waits for rank 0
    deadline = time.monotonic() + 120
    while not arrived.check(["joined/1"]):
        assert time.monotonic() < deadline and not answers, f"never reached the rendezvous: {answers}"
        time.sleep(0.1)
    time.sleep(0.5)  # from the mark to its wait
    assert not answers, answers
    stopped = time.monotonic()
    os.killpg(svc.proc.pid, signal.SIGTERM)
    assert exit_code(svc, 60) == 0, svc.log_tail()
    took = time.monotonic() - stopped
    client.join(30)
    assert len(answers) == 1 and isinstance(answers[0], grpc.RpcError), answers
    assert answers[0].code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), answers[0]
    _, alive = psutil.wait_procs(engines, timeout=15)
    assert alive == [], f"left behind: {alive}"
    assert re.search(r"rollout service stopped \(\d+\.\ds after the stop began\)", svc.log_path.read_text())
    print(f"stopped in {took:.1f}s")
