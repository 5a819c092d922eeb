"""The reference engine, the actor loop, startup errors and shutdown, on real processes.

These use the HF reference engine (starts in seconds) where the engine is not the point: the actor
publishes to a real Redis, shutdown is a real SIGTERM. Tolerance for the reference engine against
the independent recompute is 2e-4 per token, as for vLLM: both are the same float32 torch model
under the same transform, differing only in KV-cached (one token at a time) vs full-sequence
attention; over 150 tokens with perturbed, larger-norm weights we observe up to ~5e-5.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from parity.sampling import SamplingTransform
from parity.server import bearer
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, rollouts_pb2
from tests.fakes.rollout_helpers import HfScorer, perturbed_state_dict, push_weights
from tests.service_exit import exit_code

TOKEN = "reference-test-token"
EXACT_TOL = 2e-4


def _stub(service) -> rollout_pb2_grpc.RolloutServiceStub:
    return rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(service.address))


def _wait_for_entries(queue, count: int, deadline: float, service) -> None:
    """Until the rollout stream holds `count` entries; fails with the service's log at `deadline`."""
    while queue.redis.xlen(queue.stream) < count:
        assert time.monotonic() < deadline, service.log_tail()
        time.sleep(0.1)


def _sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "n": 2, **fields})


def test_unknown_model_fails_at_startup_naming_the_field() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "commands.main", "serve", "rollout", "--model", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "model" in result.stderr and "no-such-model" in result.stderr


def test_bad_config_fails_at_startup_naming_the_field() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "commands.main", "serve", "rollout", "--update_mode", "sometimes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "update_mode" in result.stderr


@pytest.mark.slow
def test_reference_engine_is_the_trainers_numerics_and_updates_in_flight(
    start_services, tiny_model: Path
) -> None:
    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--auth_token", TOKEN
    )
    stub = _stub(service)
    scorer = HfScorer(tiny_model)
    prompt = list(range(10, 30))
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.8, 20, 0.9), (0.6, 5, 0.7)]:
        reply = stub.Generate(
            rollout_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=_sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=3),
            )
        )
        for comp in reply.completions:
            expected = scorer.score(prompt, comp.token_ids, SamplingTransform(temperature, top_k, top_p))
            assert max(abs(a - b) for a, b in zip(comp.logprobs, expected, strict=True)) < EXACT_TOL
    # An in-flight keep-mode update: versions switch between two decode steps, and the logprobs after
    # the switch are the new weights over the KV the old weights computed. Whether a completion is
    # still decoding when the pause lands is up to the box's load (all four may have ended, at EOS
    # or max_tokens): each try checks every completion, and a try where none switched goes again
    # with the next version.
    request = rollout_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=_sampling(max_tokens=150, n=4))
    old_state, switched, version = None, 0, 0
    while not switched and version < 8:
        version += 1
        new_state = perturbed_state_dict(tiny_model, seed=6 + version)
        reply = stub.Generate.future(request, timeout=120)
        # Until the request runs; one that has already ended (or failed) leaves this try unswitched.
        while (
            stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).num_running_requests == 0
            and not reply.done()
        ):
            time.sleep(0.02)
        time.sleep(0.05)
        stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(), metadata=bearer(TOKEN))
        update = push_weights(stub, new_state, version, metadata=bearer(TOKEN))
        stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), metadata=bearer(TOKEN))
        assert update.outcome == rollout_pb2.UPDATE_OUTCOME_APPLIED, update.error
        for comp in reply.result().completions:  # a completion may end (EOS) before the update
            versions = list(comp.token_weight_versions)
            switch_at = versions.index(version) if version in versions else len(versions)
            assert versions == [version - 1] * switch_at + [version] * (len(versions) - switch_at)
            if switch_at in (0, len(versions)):  # all tokens under one version
                scorer.load(new_state if switch_at == 0 else old_state)
                expected = scorer.score(prompt, comp.token_ids, SamplingTransform())
            else:
                switched += 1
                expected = scorer.score_keep(
                    prompt, comp.token_ids, switch_at, old_state, new_state, SamplingTransform()
                )
            assert max(abs(a - b) for a, b in zip(comp.logprobs, expected, strict=True)) < EXACT_TOL
        old_state = new_state
    assert switched, f"no completion was running at any of {version} updates"
    assert stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).weight_version == version


@pytest.mark.slow
def test_requests_during_shutdown_are_unavailable_and_inflight_ones_finish(
    start_services, tiny_model: Path
) -> None:
    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--shutdown_grace_s", "30"
    )
    stub = _stub(service)
    long_request = rollout_pb2.GenerateRequest(
        prompt_token_ids=[5, 6, 7], sampling=_sampling(max_tokens=400, n=4)
    )
    future = stub.Generate.future(long_request, timeout=120)
    while stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).num_running_requests == 0:
        assert not future.done(), "the long request ended before it was seen running"
        time.sleep(0.02)
    service.signal(signal.SIGTERM)
    # A request that arrives before the service has handled SIGTERM is served; once it has, new
    # requests are refused while the running one finishes.
    deadline = time.monotonic() + 30
    while True:
        try:
            stub.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=[5], sampling=_sampling()), timeout=10)
        except grpc.RpcError as refused:
            error = refused
            break
        assert time.monotonic() < deadline, "new requests still served 30 s after SIGTERM"
        time.sleep(0.05)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "shutting down" in error.details()
    finished = future.result()
    assert len(finished.completions) == 4  # completed normally (EOS or length), not aborted
    assert all(c.finish_reason != common_pb2.FINISH_REASON_ABORT for c in finished.completions)
    assert exit_code(service, 60) == 0, service.log_tail()


# Ctrl-C as a terminal delivers it, whatever this pytest worker passes on: in the suite a child once
# inherited SIGINT ignored or blocked (its main thread sat in the wait loop 30 s after SIGINT). The
# launcher, evaluate()'s caller, installs its own SIGINT handler the same way.
_EVALUATE = """
import faulthandler, signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view when it does not stop
from commands.run.evaluation import evaluate
from tests.reward_helpers import make_task
print("evaluating", flush=True)
evaluate(sys.argv[1], make_task(), num_prompts=3, max_tokens=8, use_chat_template=False, label="x",
         timeout_s=600.0)
"""


@pytest.mark.slow
def test_an_interrupted_evaluation_stops_at_once_with_its_requests_in_flight(
    start_services, tiny_model: Path
) -> None:
    """Ctrl-C during a held-out evaluation whose requests cannot be served (generation paused):
    the evaluation stops within seconds, not when its Generate calls time out (600 s)."""
    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--auth_token", TOKEN
    )
    stub = _stub(service)
    stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(), metadata=bearer(TOKEN))
    proc = subprocess.Popen(
        [sys.executable, "-c", _EVALUATE, service.address],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "evaluating"
        deadline = time.monotonic() + 120  # its Generate calls are sent and wait for the resume
        while (
            _stub(service)
            .GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10)
            .num_running_requests
            < 1
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "no request of the evaluation arrived"
            time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            proc.kill()
            pytest.fail(f"the evaluation was still running 30 s after SIGINT:\n{proc.stdout.read()[-6000:]}")
        output = proc.stdout.read()
        assert time.monotonic() - started < 30
        assert proc.returncode != 0 and "KeyboardInterrupt" in output, output[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), metadata=bearer(TOKEN))
    # the service is unharmed: a request is served after the resume
    reply = stub.Generate(
        rollout_pb2.GenerateRequest(prompt_token_ids=[5, 6], sampling=_sampling()), timeout=60
    )
    assert len(reply.completions) == 2


@pytest.mark.slow
def test_an_evaluation_waits_out_the_services_admission_limits(start_services, tiny_model: Path) -> None:
    """A held-out evaluation sends more requests at once (3 greedy, 3 pass@2) than the service
    admits (here one): the refused ones (RESOURCE_EXHAUSTED, with a retry hint) are sent again
    after the hint, and every prompt is scored."""
    from commands.run.evaluation import evaluate
    from parity.ports import free_port
    from tests.reward_helpers import make_task
    from tests.test_metrics_endpoints import sample_value, scrape

    port = free_port()
    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--max_inflight_requests", "1",
        "--metrics_port", str(port),
    )  # fmt: skip
    result = evaluate(
        service.address, make_task(), num_prompts=3, max_tokens=8, use_chat_template=False, label="x",
        concurrency=6, timeout_s=120.0, pass_k=2, sampling=_sampling(temperature=1.0, seed=3),
    )  # fmt: skip
    assert len(result.items) == 3 and all(item.completion is not None for item in result.items)
    assert all(item.sample_rewards is not None and len(item.sample_rewards) == 2 for item in result.items)
    refused = sample_value(scrape(port), "parity_rollout_refused_requests_total", limit="in_flight_requests")
    assert refused > 0  # the evaluation did meet the limit


@pytest.mark.slow
def test_actor_publishes_scored_groups_with_backpressure(
    start_services, tiny_model: Path, redis_url: str
) -> None:
    from parity.rollout_queue import RolloutQueue

    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--actor", "true",
        "--redis_url", redis_url, "--group_size", "3", "--max_tokens", "6", "--max_lag", "2",
        "--skip_zero_variance", "false",
        "--groups_per_step", "2", "--concurrency", "3", "--worker_id", "w0", "--temperature", "0.9",
        "--top_k", "40",
        env={"OTEL_TRACES_EXPORTER": "console"},
    )  # fmt: skip
    queue = RolloutQueue(redis_url)
    deadline = time.monotonic() + 60
    _wait_for_entries(queue, 4, deadline, service)
    time.sleep(1.5)  # the actor must now be blocked: backlog == max_lag * groups_per_step
    assert queue.redis.xlen(queue.stream) == 4
    entries = queue.redis.xrange(queue.stream)
    group_ids = set()
    for _entry_id, fields in entries:
        group = rollouts_pb2.RolloutGroup.FromString(fields[b"group"])
        group_ids.add(group.group_id)
        assert fields[b"group_id"].decode() == group.group_id and group.worker_id == "w0"
        assert fields[b"traceparent"].startswith(b"00-")  # W3C traceparent of the publish span
        assert (group.sampling.temperature, group.sampling.top_k, group.sampling.n) == (
            pytest.approx(0.9),
            40,
            3,
        )
        assert group.task == "arithmetic_final" and group.prompt_text.startswith("What is ")
        assert group.logprobs_mode == common_pb2.LOGPROBS_MODE_PROCESSED
        assert (group.min_weight_version, group.max_weight_version) == (0, 0)
        assert [s.rollout_id for s in group.samples] == [f"{group.group_id}/{i}" for i in range(3)]
        for sample in group.samples:
            assert len(sample.token_ids) == len(sample.logprobs) == len(sample.token_weight_versions) > 0
            assert sample.reward in (0.0, 1.0)
    assert len(group_ids) == 4
    # The trainer consumes: the actor resumes.
    ids = [entry_id.decode() for entry_id, _ in entries]
    queue.redis.xreadgroup(queue.group, "test", {queue.stream: ">"}, count=4)
    queue.redis.xack(queue.stream, queue.group, *ids)
    _wait_for_entries(queue, 6, deadline + 60, service)


@pytest.mark.slow
def test_late_joiner_is_not_serving_until_it_has_the_latest_version(
    start_services, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    """Real broadcast service and the trainer's real Publisher: v1 is published before the worker
    exists (an epoch with no worker: nothing is sent); the worker registers at v0 and must not
    serve (health, Generate) until the trainer's catch-up has brought it to v1."""
    from parity import health
    from parity.v1 import broadcast_pb2 as pb
    from parity.v1 import broadcast_pb2_grpc
    from parity.weights.sender import Publisher

    broadcast = start_services("broadcast", "--auth_token", TOKEN, "--heartbeat_timeout_s", "30")
    stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(grpc.insecure_channel(broadcast.address))
    named = list(perturbed_state_dict(tiny_model, seed=11).items())
    publisher = Publisher(broadcast.address, "tiny", auth_token=TOKEN, bucket_bytes=1 << 20)
    request.addfinalizer(publisher.close)
    publisher.publish_tensors(named, 1)  # keeps the snapshot and serves catch-ups from it

    worker = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--auth_token", TOKEN,
        "--broadcast_address", broadcast.address, "--worker_id", "late", "--heartbeat_interval_s", "0.5",
        wait=False,
    )  # fmt: skip
    worker.wait_ready(240)
    rollout = _stub(worker)
    assert health.check(worker.address) == (True, "SERVING")
    assert rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).weight_version == 1
    reply = rollout.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=[5, 6], sampling=_sampling(n=1)))
    assert set(reply.completions[0].token_weight_versions) == {1}
    log = worker.log_path.read_text()
    assert "health: SERVING (weight_version 0)" not in log  # never served the stale version
    assert "registered as late" in log
    deadline = time.monotonic() + 30
    while True:  # the broadcast service sees the worker at v1 through the ack and the heartbeats
        workers = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest()).workers
        if [(w.worker_id, w.weight_version) for w in workers] == [("late", 1)]:
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)


@pytest.mark.slow
def test_sync_actor_generates_one_step_per_version(start_services, tiny_model: Path, redis_url: str) -> None:
    from parity.rollout_queue import RolloutQueue

    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--actor", "true",
        "--redis_url", redis_url, "--group_size", "2", "--max_tokens", "4", "--groups_per_step", "3",
        "--mode", "sync", "--skip_zero_variance", "false", "--auth_token", TOKEN,
    )  # fmt: skip
    queue = RolloutQueue(redis_url)
    deadline = time.monotonic() + 60
    _wait_for_entries(queue, 3, deadline, service)
    time.sleep(1.0)
    assert queue.redis.xlen(queue.stream) == 3  # waits for the next version, consumed or not
    push_weights(_stub(service), perturbed_state_dict(tiny_model, seed=5), 1, metadata=bearer(TOKEN))
    _wait_for_entries(queue, 6, deadline + 60, service)
    time.sleep(1.0)
    groups = [rollouts_pb2.RolloutGroup.FromString(f[b"group"]) for _, f in queue.redis.xrange(queue.stream)]
    assert [g.max_weight_version for g in groups] == [0, 0, 0, 1, 1, 1]
    assert [g.min_weight_version for g in groups] == [0, 0, 0, 1, 1, 1]


def test_dynamic_sampling_drops_flat_groups_and_never_starves_the_trainer() -> None:
    """`Actor.offer`: a group with reward variance is published; a flat one is dropped and counted,
    up to 4 * groups_per_step in a row, after which the next one goes through anyway."""
    import asyncio
    from types import SimpleNamespace

    from rollout.actor import Actor

    actor = Actor.__new__(Actor)  # only the dynamic-sampling state; no engine or queue needed
    actor.config, actor.groups_per_step = SimpleNamespace(skip_zero_variance=True), 2
    actor.zero_variance_dropped, actor._dropped_in_a_row, actor._group_traceparents = 0, 0, {}
    actor._group_draws = {}  # group id -> prompt draw index (the stream position recorded on publish)
    published: list[str] = []

    async def publish(group) -> str:
        published.append(group.group_id)
        return group.group_id

    actor.publish = publish

    def group(name: str, *rewards: float) -> rollouts_pb2.RolloutGroup:
        return rollouts_pb2.RolloutGroup(
            group_id=name, samples=[rollouts_pb2.RolloutSample(reward=r) for r in rewards]
        )

    async def offer_all() -> list[bool]:
        offers = [group("mixed", 0, 1, 0)] + [group(f"flat{i}", 0, 0, 0) for i in range(9)]
        offers.append(group("all-right", 1, 1, 1))
        return [await actor.offer(g) for g in offers]

    outcomes = asyncio.run(offer_all())
    # limit 8: flat0..flat7 dropped, flat8 forced through (resets the run), all-right dropped again.
    assert outcomes == [True] + [False] * 8 + [True, False]
    assert published == ["mixed", "flat8"]
    assert actor.zero_variance_dropped == 9
    actor.config.skip_zero_variance = False
    assert asyncio.run(actor.offer(group("flat-off", 0, 0))) and published[-1] == "flat-off"


def _sync_actor_stand_in(concurrency: int, groups_per_step: int, versions: int, useful):
    """An `Actor` running only its sync loop: generation is replaced by a stand-in whose group is
    flat unless `useful(draw)`, and publishing by a list; the trainer's next version arrives when
    a step is complete. Returns (actor, published (version, draw) pairs, generated draws, rounds)."""
    import itertools
    from types import SimpleNamespace

    from rollout.actor import Actor

    actor = Actor.__new__(Actor)
    actor.config = SimpleNamespace(skip_zero_variance=True, concurrency=concurrency, max_groups=0)
    actor.groups_per_step, actor.groups_published, actor.backpressure_wait_s = groups_per_step, 0, 0.0
    actor.zero_variance_dropped, actor._dropped_in_a_row, actor.surplus_groups = 0, 0, 0
    actor._group_traceparents, actor._group_draws, actor._returned = {}, {}, []
    actor._sync_progress = (-1, 0)
    actor._seed_base = 0
    actor._draws, actor._prompts = itertools.count(), itertools.repeat(None)
    actor.servicer = SimpleNamespace(caught_up=True, shutting_down=False)
    actor.engine = SimpleNamespace(weight_version=0)
    published: list[tuple[int, int]] = []
    generated: list[int] = []
    rounds: list[int] = []

    async def one_group(prompt, seed, draw):
        generated.append(draw)
        actor._group_draws[f"d{draw}"] = draw
        reward = [0.0, 1.0] if useful(draw) else [0.0, 0.0]
        return rollouts_pb2.RolloutGroup(
            group_id=f"d{draw}", samples=[rollouts_pb2.RolloutSample(reward=r) for r in reward]
        )

    async def publish(group) -> str:
        version = actor.engine.weight_version
        published.append((version, actor._group_draws.pop(group.group_id)))
        actor.groups_published += 1
        if sum(v == version for v, _ in published) == groups_per_step:
            actor.engine.weight_version += 1  # the trainer's step
            actor.servicer.shutting_down = actor.engine.weight_version == versions
        return group.group_id

    round_size = actor._round_size

    def recorded_round_size(need: int) -> int:
        rounds.append(round_size(need))
        return rounds[-1]

    actor.one_group, actor.publish, actor._round_size = one_group, publish, recorded_round_size
    return actor, published, generated, rounds


def test_sync_rounds_publish_the_same_groups_at_any_round_size() -> None:
    """Sync mode draws bigger rounds as groups get dropped, and returns the surplus after a step's
    last published group to the stream: the groups each version publishes are those that drawing
    one step's need at a time publishes, and a surplus prompt is generated again at the next version."""
    import asyncio

    def useful(draw: int) -> bool:
        return draw % 5 in (0, 3)  # 2 of every 5 groups have reward variance

    one_at_a_time = _sync_actor_stand_in(1, 2, 6, useful)
    rounds_of_up_to_8 = _sync_actor_stand_in(8, 2, 6, useful)
    for actor, *_ in (one_at_a_time, rounds_of_up_to_8):
        asyncio.run(asyncio.wait_for(actor._sync_loop(), 30))

    (_, published_1, generated_1, rounds_1), (actor_8, published_8, generated_8, rounds_8) = (
        one_at_a_time,
        rounds_of_up_to_8,
    )
    useful_draws = [0, 3, 5, 8, 10, 13, 15, 18, 20, 23, 25, 28]
    assert published_1 == [(i // 2, draw) for i, draw in enumerate(useful_draws)]  # 2 per version
    assert published_8 == published_1
    assert max(rounds_1) == 2 and max(rounds_8) > 2 and len(rounds_8) < len(rounds_1)
    assert max(rounds_8) <= 8
    # Surplus: drawn after a step's last published group, generated again at the next version.
    assert actor_8.surplus_groups > 0
    assert len(generated_8) > len(set(generated_8))  # a returned prompt was generated twice
    assert len(generated_1) == len(set(generated_1))


@pytest.mark.slow
def test_sync_actor_with_dynamic_sampling_still_publishes_each_step(
    start_services, tiny_model: Path, redis_url: str
) -> None:
    """The tiny model never answers arithmetic: every group is flat. The sync actor drops 4 per
    version (limit 4 * groups_per_step), then publishes one, and waits for the next version."""
    from parity.rollout_queue import RolloutQueue

    service = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--actor", "true",
        "--redis_url", redis_url, "--group_size", "2", "--max_tokens", "3", "--groups_per_step", "1",
        "--mode", "sync", "--skip_zero_variance", "true", "--auth_token", TOKEN,
    )  # fmt: skip
    queue = RolloutQueue(redis_url)
    deadline = time.monotonic() + 60
    _wait_for_entries(queue, 1, deadline, service)
    time.sleep(1.0)
    assert queue.redis.xlen(queue.stream) == 1
    assert (
        # Rounds grow as groups are dropped (1, 2, 4 prompts): the 4th flat group is dropped, the 5th
        # published anyway, and the round's last two prompts go back to the stream.
        "published 1 groups (4 dropped for zero variance so far, 2 surplus returned to the stream); waiting for v1"
        in service.log_path.read_text()
    )
    group = rollouts_pb2.RolloutGroup.FromString(queue.redis.xrange(queue.stream)[0][1][b"group"])
    assert {s.reward for s in group.samples} == {0.0}
