"""Tracing: no cost when off, messaging links from traceparents, gRPC context propagation."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from parity import tracing
from parity.config import ServiceConfig
from parity.server import GrpcServer, channel
from parity.v1 import rollout_pb2, rollout_pb2_grpc


@pytest.fixture
def exporter():
    spans = InMemorySpanExporter()
    assert tracing.init("parity-test", exporter=spans)
    yield spans
    tracing.shutdown()
    assert not tracing.enabled()


def test_tracing_off_by_default_costs_no_imports_and_little_time() -> None:
    """Off: no SDK or instrumentation import, a shared no-op span, and sub-microsecond-scale cost."""
    script = textwrap.dedent(
        """
        import json, sys, time
        from parity import tracing
        on = tracing.init("parity-rollout")
        result = {"on": on, "sdk": "opentelemetry.sdk" in sys.modules,
                  "instr": "opentelemetry.instrumentation.grpc" in sys.modules,
                  "tp": tracing.current_traceparent(), "interceptors": tracing.server_interceptors()
                  + tracing.client_interceptors(), "valid": None}
        with tracing.span("generate", {"parity.weight_version": 1}) as sp:
            result["valid"] = sp.get_span_context().is_valid
        def timed(fn, n=20000):
            best = 1e9
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - t0) / n)
            return best
        def off():
            with tracing.span("generate", {"parity.weight_version": 1}):
                pass
        def bare():
            pass
        result["off_s"] = timed(off) - timed(bare)
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        tracing.init("parity-rollout", exporter=InMemorySpanExporter())
        result["on_s"] = timed(off, 2000) - timed(bare)
        print(json.dumps(result))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"span cost off {result['off_s'] * 1e9:.0f} ns, on {result['on_s'] * 1e9:.0f} ns")
    assert result["on"] is False
    assert result["sdk"] is False, "the SDK must not be imported when tracing is off"
    assert result["instr"] is False
    assert result["tp"] == "" and result["interceptors"] == [] and result["valid"] is False
    # A no-op `with` costs a few hundred ns; 5 µs leaves room for a loaded 2-core CI box.
    assert result["off_s"] < 5e-6
    # Recording a span (SDK, synchronous export) is far more expensive than the no-op path.
    assert result["on_s"] > 3 * max(result["off_s"], 1e-7)


def test_otel_env_turns_tracing_on_with_service_name() -> None:
    """OTEL_TRACES_EXPORTER=console turns tracing on; OTEL_SERVICE_NAME overrides the default name."""
    script = (
        "from parity import tracing\n"
        "assert tracing.init('parity-trainer')\n"
        "with tracing.span('train step', {'parity.step': 1}): pass\n"
        "tracing.shutdown()\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "trainer-a"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    span = json.loads(out.stdout)
    assert span["name"] == "train step"
    assert span["resource"]["attributes"]["service.name"] == "trainer-a"
    assert span["attributes"]["parity.step"] == 1


def test_parity_run_children_trace_as_three_services() -> None:
    """Under `parity run` a user's OTEL_SERVICE_NAME names the run, not every service alike: each
    child traces as NAME-<kind>, with an instance id of its own (rollout0 and rollout1 apart)."""
    from commands.run.supervisor import trace_env

    user = {"OTEL_SERVICE_NAME": "myrun", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
    script = (
        "from parity import tracing\n"
        "assert tracing.init('parity-default')\n"
        "with tracing.span('s'): pass\n"
        "tracing.shutdown()\n"
    )
    seen = {}
    for kind, name in [
        ("broadcast", "broadcast"),
        ("trainer", "trainer"),
        ("rollout", "rollout0"),
        ("rollout", "rollout1"),
    ]:
        env = {**os.environ, **user, "OTEL_TRACES_EXPORTER": "console", **trace_env(kind, name, "m1", user)}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        seen[name] = json.loads(out.stdout)["resource"]["attributes"]
    assert {n: a["service.name"] for n, a in seen.items()} == {
        "broadcast": "myrun-broadcast",
        "trainer": "myrun-trainer",
        "rollout0": "myrun-rollout",
        "rollout1": "myrun-rollout",
    }
    assert len({a["service.instance.id"] for a in seen.values()}) == 4
    assert all(a["deployment.environment"] == "test" for a in seen.values())
    # no name given: each keeps its default; an instance id the user chose is kept
    assert "OTEL_SERVICE_NAME" not in trace_env("trainer", "trainer", "m1", {})
    assert trace_env("trainer", "trainer", "m1", {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=x"}) == {}


def test_consumer_span_links_to_each_producer(exporter: InMemorySpanExporter) -> None:
    """A consume span links (not parents) to every valid traceparent; bad or empty ones are skipped."""
    parents = []
    for group in range(2):
        with tracing.span(
            "publish",
            {tracing.ATTR_GROUP_ID: f"g{group}", tracing.ATTR_MAX_VERSION: 3},
            kind="producer",
        ):
            parents.append(tracing.current_traceparent())
    assert all(tp.startswith("00-") and len(tp) == 55 for tp in parents)
    garbage = ["", "not-a-traceparent", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", parents[0]]
    attrs = tracing.messaging_attributes("receive", "parity:rollouts", batch_count=2)
    with tracing.span("consume", attrs, links_from=[*parents, *garbage], kind="consumer"):
        consume_tp = tracing.current_traceparent()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    consume = spans["consume"]
    assert consume.kind == trace.SpanKind.CONSUMER
    assert consume.parent is None, "a consumer of a batch must not become a child of one producer"
    linked = {(link.context.trace_id, link.context.span_id) for link in consume.links}
    produced = {
        (s.context.trace_id, s.context.span_id) for s in exporter.get_finished_spans() if s.name == "publish"
    }
    assert linked == produced and len(linked) == 2
    assert consume.attributes["messaging.system"] == "redis"
    assert consume.attributes["messaging.batch.message_count"] == 2
    assert consume_tp.split("-")[1] == format(consume.context.trace_id, "032x")


def test_parent_traceparent_makes_a_remote_child(exporter: InMemorySpanExporter) -> None:
    with tracing.span("publish version", {tracing.ATTR_WEIGHT_VERSION: 4}):
        tp = tracing.current_traceparent()
    with tracing.span("broadcast transfer", parent_traceparent=tp):
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["broadcast transfer"].parent.span_id == spans["publish version"].context.span_id
    assert spans["broadcast transfer"].context.trace_id == spans["publish version"].context.trace_id


class _VersionedRollout(rollout_pb2_grpc.RolloutServiceServicer):
    async def Generate(self, request, context):
        with tracing.span("generate", {tracing.ATTR_WEIGHT_VERSION: 7}):
            return rollout_pb2.GenerateResponse(request_id=request.request_id)


async def _traced_round_trip() -> str:
    server = GrpcServer(
        ServiceConfig(), [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name]
    )
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(_VersionedRollout(), server.server)
    port = await server.start()
    await server.set_serving(True)
    try:
        async with channel(f"127.0.0.1:{port}") as chan:
            stub = rollout_pb2_grpc.RolloutServiceStub(chan)
            with tracing.span("broadcast transfer", {tracing.ATTR_WEIGHT_VERSION: 7}):
                reply = await stub.Generate(rollout_pb2.GenerateRequest(request_id="r1", prompt_text="x"))
        return reply.request_id
    finally:
        await server.stop(0)


def test_grpc_calls_carry_context_from_client_to_server(exporter: InMemorySpanExporter) -> None:
    """GrpcServer/channel add the standard gRPC instrumentation: client -> server -> handler spans."""
    assert asyncio.run(_traced_round_trip()) == "r1"
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    rpc = "/parity.v1.RolloutService/Generate"
    assert not any("Health" in name for name in by_name), "health checks must not be traced"
    (outer,) = by_name["broadcast transfer"]
    client = next(s for s in by_name[rpc] if s.kind == trace.SpanKind.CLIENT and s.parent is not None)
    server = next(
        s
        for s in by_name[rpc]
        if s.kind == trace.SpanKind.SERVER and s.context.trace_id == outer.context.trace_id
    )
    (handler,) = [s for s in by_name["generate"] if s.context.trace_id == outer.context.trace_id]
    assert client.parent.span_id == outer.context.span_id
    assert server.parent.span_id == client.context.span_id
    assert handler.parent.span_id == server.context.span_id
    assert handler.attributes[tracing.ATTR_WEIGHT_VERSION] == 7
    assert server.resource.attributes["service.name"] == "parity-test"


def test_sync_channels_are_instrumented_when_on(exporter: InMemorySpanExporter) -> None:
    """`instrument_channel` traces a synchronous client (the trainer's publisher uses one)."""
    import grpc

    async def serve_and_call() -> str:
        server = GrpcServer(
            ServiceConfig(), [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name]
        )
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(_VersionedRollout(), server.server)
        port = await server.start()

        def call() -> str:
            with tracing.instrument_channel(grpc.insecure_channel(f"127.0.0.1:{port}")) as chan:
                stub = rollout_pb2_grpc.RolloutServiceStub(chan)
                with tracing.span("publish_version", {tracing.ATTR_WEIGHT_VERSION: 2}):
                    return stub.Generate(rollout_pb2.GenerateRequest(request_id="s1")).request_id

        try:
            return await asyncio.to_thread(call)
        finally:
            await server.stop(0)

    assert asyncio.run(serve_and_call()) == "s1"
    spans = exporter.get_finished_spans()
    (outer,) = [s for s in spans if s.name == "publish_version"]
    rpc = [s for s in spans if s.name == "/parity.v1.RolloutService/Generate"]
    client = next(s for s in rpc if s.kind == trace.SpanKind.CLIENT)
    server = next(s for s in rpc if s.kind == trace.SpanKind.SERVER)
    assert client.parent.span_id == outer.context.span_id
    assert server.parent.span_id == client.context.span_id


def test_instrument_channel_is_identity_when_off() -> None:
    tracing.shutdown()
    sentinel = object()
    assert tracing.instrument_channel(sentinel) is sentinel


@pytest.mark.parametrize(
    ("env", "exporter_module"),
    [
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ""),
        ({"OTEL_TRACES_EXPORTER": "none"}, ""),
    ],
)
def test_standard_otel_variables_choose_the_exporter(env: dict[str, str], exporter_module: str) -> None:
    script = (
        "import json\n"
        "from parity import tracing\n"
        "on = tracing.init('parity-broadcast')\n"
        "procs = tracing._provider._active_span_processor._span_processors if on else ()\n"
        "print(json.dumps([p.span_exporter.__class__.__module__ for p in procs]))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", script], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ([exporter_module] if exporter_module else [])


def test_a_failed_weight_update_marks_its_spans(exporter: InMemorySpanExporter) -> None:
    """The coordinator's update of one worker (real code; the worker and the registry are FAKES):
    an UpdateWeights that failed ends its broadcast_transfer span in error, and a failed ack its
    verify span, with the cause, not green."""
    import asyncio
    from unittest import mock

    import grpc

    from broadcast.coordinator import Coordinator
    from parity.v1 import common_pb2, rollout_pb2

    class FakeWorker:
        def __init__(self, mode: str) -> None:
            self.mode = mode

        async def UpdateWeights(self, request, **kwargs):
            if self.mode == "rpc":
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "worker down"
                )
            return rollout_pb2.UpdateWeightsResponse(
                outcome=rollout_pb2.UPDATE_OUTCOME_FAILED, error="lm_head differs"
            )

    async def scenario() -> list[str]:
        config = mock.MagicMock(transfer_timeout_s=1.0, rpc_margin_s=1.0, auth_token="")
        membership = mock.MagicMock()
        membership.live.get.return_value = mock.MagicMock(attempted_version=0)
        record = mock.MagicMock(version=3)
        record.plan.return_value = common_pb2.TransferPlan(version=3)
        record.plan_bytes.return_value = 10
        with tracing.span("publish_version"):
            record.traceparent = tracing.current_traceparent()
        coordinator = Coordinator(config, mock.MagicMock(), membership, 0, lambda: None)
        coordinator.rendezvous = lambda *args: common_pb2.Rendezvous()
        errors = []
        for mode in ("rpc", "failed_ack"):
            coordinator._stub = lambda worker, m=mode: FakeWorker(m)
            errors.append(await coordinator._update("w1", record, "g", "s", 1, 2, 0.0))
        return errors

    errors = asyncio.run(scenario())
    assert "UNAVAILABLE" in errors[0] and errors[1]
    failed = [s for s in exporter.get_finished_spans() if s.status.status_code == trace.StatusCode.ERROR]
    assert [s.name for s in failed] == ["broadcast_transfer", "verify"], [
        (s.name, s.status.status_code) for s in exporter.get_finished_spans()
    ]
    assert "UNAVAILABLE" in failed[0].status.description and "lm_head" in failed[1].status.description


def test_a_span_keeps_a_link_to_every_group_of_the_largest_batch(exporter: InMemorySpanExporter) -> None:
    """train_step links every group it trains (run.groups_per_step <= 1024); the SDK kept 128."""
    parents = []
    for group in range(1024):
        with tracing.span("publish", {tracing.ATTR_GROUP_ID: f"g{group}"}, kind="producer"):
            parents.append(tracing.current_traceparent())
    with tracing.span("train_step", links_from=parents):
        pass
    (step,) = [s for s in exporter.get_finished_spans() if s.name == "train_step"]
    assert len(step.links) == 1024


def test_openai_endpoint_requests_are_server_spans_under_the_callers_trace(
    exporter: InMemorySpanExporter,
) -> None:
    """Each HTTP request to the OpenAI-compatible endpoint is a server span named METHOD ROUTE, the
    child of the harness's traceparent; a 5xx marks it failed, a 4xx does not."""
    import urllib.error
    import urllib.request

    from parity.config import ParityConfig
    from services.rollout.openai_api import OpenAIServer

    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    async def scenario() -> dict[str, int]:
        config = ParityConfig(rollout={"openai_port": 0}, run={"redis_url": "redis://127.0.0.1:1/0"})
        endpoint = OpenAIServer(config, servicer=None)  # never reaches Redis: no session finishes
        port = await endpoint.start()

        def call(method: str, path: str, body: bytes | None = None) -> int:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}{path}", data=body, method=method, headers={"traceparent": caller}
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        try:
            return {
                "models": await asyncio.to_thread(call, "GET", "/v1/models"),
                "finish": await asyncio.to_thread(call, "POST", "/v1/sessions/nope/finish", b'{"reward": 1}'),
                # no servicer behind this endpoint: the handler raises, the boundary answers 500
                "chat": await asyncio.to_thread(
                    call, "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}'
                ),
            }
        finally:
            await endpoint.stop()

    codes = asyncio.run(scenario())
    assert codes == {"models": 200, "finish": 404, "chat": 500}
    spans = {s.name: s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER}
    assert set(spans) == {
        "GET /v1/models",
        "POST /v1/sessions/{session_id}/finish",
        "POST /v1/chat/completions",
    }
    for span in spans.values():
        assert f"{span.context.trace_id:032x}" == caller.split("-")[1]
        assert span.parent is not None and f"{span.parent.span_id:016x}" == caller.split("-")[2]
    failed = {name for name, span in spans.items() if span.status.status_code == trace.StatusCode.ERROR}
    assert failed == {"POST /v1/chat/completions"}
    finish = spans["POST /v1/sessions/{session_id}/finish"]
    assert finish.attributes["http.response.status_code"] == 404
    assert finish.attributes["parity.session_id"] == "nope"
