"""The three services running together: their /metrics, and one rollout's trace across them.

One pipeline is started for the whole module (real processes: broadcast, rollout with its actor on
the tiny model's reference engine, trainer, a private redis-server) with the standard OTEL_* variables pointing
at an OTLP/gRPC receiver inside this test, so spans travel exactly as they would to a collector.
It runs until the trainer has published version 1 and the rollout service serves it.

- Every service's /metrics parses (prometheus_client's parser), carries exactly the names listed
  in docs/observability.md, and follows the Prometheus conventions (parity_<service>_ prefix,
  counters end in _total, seconds not `_s`, only low-cardinality labels).
- One rollout's life is traced across the three services: publish (rollout) -> consume and
  train_step (trainer, messaging *links*) -> publish_version (trainer -> broadcast, gRPC
  parent/child) -> broadcast_transfer (broadcast) -> UpdateWeights and swap (rollout).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from parity.ports import free_port
from parity.procs import ServiceProcess, start_service

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "observability.md"
SERVICES = ("rollout", "trainer", "broadcast")
ALLOWED_LABELS = {"outcome", "reason", "direction"}
pytestmark = pytest.mark.slow


@dataclass
class RecordedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)


def _value(any_value) -> Any:
    which = any_value.WhichOneof("value")
    return getattr(any_value, which) if which else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: what a collector's `otlp` receiver would get."""

    def __init__(self) -> None:
        self.spans: list[RecordedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for sp in scope_spans.spans:
                    received.append(
                        RecordedSpan(
                            service=str(resource.get("service.name", "")),
                            name=sp.name,
                            trace_id=sp.trace_id.hex(),
                            span_id=sp.span_id.hex(),
                            parent_id=sp.parent_span_id.hex(),
                            kind=sp.kind,
                            attributes={a.key: _value(a.value) for a in sp.attributes},
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in sp.links],
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[RecordedSpan]:
        with self._lock:
            return list(self.spans)


def scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    for family in families.values():
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(sample_name)


def exposed_names(families: dict[str, Any]) -> set[str]:
    """Names as a user queries them: counters with _total, histograms and gauges by family name."""
    names = set()
    for family in families.values():
        name = family.name
        if not name.startswith("parity_") or name.endswith("_created"):
            continue  # prometheus_client's per-series creation timestamps
        if family.type == "counter" and not name.endswith("_total"):
            name += "_total"
        names.add(name)
    return names


def documented_names(service: str) -> set[str]:
    section = re.search(rf"^### {service}\n(.*?)(?=^### |\Z)", DOC.read_text(), re.M | re.S)
    assert section, f"docs/observability.md has no '### {service}' section"
    return set(re.findall(rf"`(parity_{service}_[a-z0-9_]+)`", section.group(1)))


@dataclass
class Pipeline:
    services: dict[str, ServiceProcess]
    metrics_ports: dict[str, int]
    receiver: OtlpReceiver


@pytest.fixture(scope="module")
def pipeline(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    import redis

    redis.Redis.from_url(redis_server).flushall()
    receiver = OtlpReceiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    log_dir = tmp_path_factory.mktemp("pipeline")
    ports = {name: free_port() for name in SERVICES}
    started: dict[str, ServiceProcess] = {}
    try:
        started["broadcast"] = start_service(
            # with the run's Redis, so the service also publishes version events there (notify_redis)
            "broadcast",
            ["--metrics_port", str(ports["broadcast"]), "--redis_url", redis_server],
            log_dir=log_dir,
            env=env,
        ).wait_ready(240)
        broadcast = started["broadcast"].address
        started["rollout"] = start_service(
            "rollout",
            [
                "--model", "tiny", "--max_model_len", "512", "--broadcast_address", broadcast,
                "--worker_id", "w0", "--actor", "true", "--redis_url", redis_server,
                "--group_size", "2", "--max_tokens", "8", "--groups_per_step", "2", "--max_lag", "2",
                "--concurrency", "2", "--metrics_port", str(ports["rollout"]), "--engine", "reference",
            ],
            log_dir=log_dir,
            env=env,
        )  # fmt: skip
        started["trainer"] = start_service(
            "trainer",
            [
                "--model", "tiny", "--redis_url", redis_server, "--broadcast_address", broadcast,
                "--run_dir", str(log_dir / "run"), "--steps", "1000", "--groups_per_step", "2",
                "--metrics_port", str(ports["trainer"]),
            ],
            log_dir=log_dir,
            env=env,
        )  # fmt: skip
        started["rollout"].wait_ready(600)
        started["trainer"].wait_ready(240)
        deadline = time.monotonic() + 600
        while True:  # until version 1 went trainer -> broadcast -> rollout
            try:
                if sample_value(scrape(ports["rollout"]), "parity_rollout_weight_version") >= 1:
                    break
            except (OSError, KeyError):
                pass
            for name, service in started.items():
                assert service.alive(), f"{name} died:\n{service.log_tail()}"
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{s.log_tail(15)}" for n, s in started.items())
                pytest.fail(f"version 1 did not reach the rollout service in time\n{logs}")
            time.sleep(0.5)
        yield Pipeline(started, ports, receiver)
    finally:
        for name in ("trainer", "rollout", "broadcast"):
            if name in started:
                started[name].stop()
        otlp.stop(0)


@pytest.mark.parametrize("service", SERVICES)
def test_metrics_endpoint_has_the_documented_names(pipeline: Pipeline, service: str) -> None:
    families = scrape(pipeline.metrics_ports[service])
    exposed = exposed_names(families)
    documented = documented_names(service)
    assert documented, f"no parity_{service}_* names documented"
    assert exposed == documented, (
        f"undocumented: {sorted(exposed - documented)}; documented but missing: {sorted(documented - exposed)}"
    )
    for family in families.values():
        if not family.name.startswith("parity_") or family.name.endswith("_created"):
            continue
        assert family.name.startswith(f"parity_{service}_"), family.name
        assert not re.search(r"_(s|secs|ms)$", family.name), f"{family.name}: use _seconds"
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        labels = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
        assert labels <= ALLOWED_LABELS, f"{family.name}: high-cardinality labels {labels - ALLOWED_LABELS}"


def test_metrics_values_follow_the_run(pipeline: Pipeline) -> None:
    rollout = scrape(pipeline.metrics_ports["rollout"])
    trainer = scrape(pipeline.metrics_ports["trainer"])
    broadcast = scrape(pipeline.metrics_ports["broadcast"])
    assert sample_value(rollout, "parity_rollout_tokens_total") > 0
    assert sample_value(rollout, "parity_rollout_weight_version") >= 1
    assert sample_value(rollout, "parity_rollout_weight_updates_total", outcome="applied") >= 1
    assert sample_value(trainer, "parity_trainer_step") >= 1
    assert sample_value(trainer, "parity_trainer_weight_version") >= 1
    assert sample_value(trainer, "parity_trainer_rollouts_trained_total") >= 2 * 2
    assert sample_value(broadcast, "parity_broadcast_latest_version") >= 1
    assert sample_value(broadcast, "parity_broadcast_workers") == 1
    assert sample_value(broadcast, "parity_broadcast_bytes_total", direction="received") > 0
    assert sample_value(broadcast, "parity_broadcast_update_duration_seconds_count") >= 1


SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # OTLP SpanKind values


def wait_for_spans(
    receiver: OtlpReceiver, wanted: set[tuple[str, str]], timeout_s: float
) -> list[RecordedSpan]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.snapshot()
        missing = wanted - {(s.service, s.name) for s in spans}
        if not missing:
            return spans
        if time.monotonic() > deadline:
            pytest.fail(f"spans never exported: {sorted(missing)}")
        time.sleep(0.5)


def test_one_rollout_life_is_traced_across_three_services(pipeline: Pipeline) -> None:
    """swap (rollout) <- UpdateWeights <- broadcast_transfer <- publish_version (broadcast) <-
    PublishVersion <- publish_version (trainer) -link-> train_step -link-> publish (rollout),
    which shares its trace with that group's generate and score; consume links to the same publish."""
    wanted = {
        ("parity-rollout", name) for name in ("rollout_group", "generate", "score", "publish", "swap")
    } | {("parity-trainer", name) for name in ("consume", "train_step", "publish_version")}
    wanted |= {("parity-broadcast", name) for name in ("publish_version", "verify", "broadcast_transfer")}
    spans = wait_for_spans(pipeline.receiver, wanted, timeout_s=30)
    by_id = {(s.trace_id, s.span_id): s for s in spans}

    def parent(span: RecordedSpan) -> RecordedSpan:
        assert span.parent_id, f"{span.service} {span.name} has no parent"
        return by_id[(span.trace_id, span.parent_id)]

    def key(span: RecordedSpan) -> tuple[str, str]:
        return (span.trace_id, span.span_id)

    def find(service: str, name: str, **where: Any) -> list[RecordedSpan]:
        return [
            s
            for s in spans
            if s.service == service
            and s.name == name
            and all(s.attributes.get(k) == v for k, v in where.items())
        ]

    # The weight update as the rollout worker saw it.
    swap = next(s for s in find("parity-rollout", "swap", outcome="applied"))
    version = swap.attributes["parity.weight_version"]
    assert version >= 1
    update = parent(swap)
    assert (update.service, update.name, update.kind) == (
        "parity-rollout", "/parity.v1.RolloutService/UpdateWeights", SERVER,
    )  # fmt: skip
    update_call = parent(update)
    assert (update_call.service, update_call.kind) == ("parity-broadcast", CLIENT)
    transfer = parent(update_call)
    assert (transfer.service, transfer.name) == ("parity-broadcast", "broadcast_transfer")
    assert transfer.attributes["parity.weight_version"] == version
    broadcast_publish = parent(transfer)
    assert (broadcast_publish.service, broadcast_publish.name) == ("parity-broadcast", "publish_version")
    assert broadcast_publish.attributes["parity.weight_version"] == version
    (verify,) = [s for s in find("parity-broadcast", "verify") if s.parent_id == broadcast_publish.span_id]
    assert verify.attributes["parity.weight_version"] == version

    # The trainer published it: its client call is the parent of the broadcast's server span.
    publish_rpc = parent(broadcast_publish)
    assert (publish_rpc.service, publish_rpc.kind) == ("parity-broadcast", SERVER)
    publish_call = parent(publish_rpc)
    assert (publish_call.service, publish_call.kind) == ("parity-trainer", CLIENT)
    trainer_publish = parent(publish_call)
    assert (trainer_publish.service, trainer_publish.name) == ("parity-trainer", "publish_version")
    assert trainer_publish.attributes["parity.weight_version"] == version

    # ... from a train step (messaging-style link), which links to the rollouts it trained on.
    steps = [by_id[link] for link in trainer_publish.links if link in by_id]
    assert steps and all((s.service, s.name) == ("parity-trainer", "train_step") for s in steps)
    step = steps[-1]
    assert step.attributes["parity.weight_version"] == version - 1
    published = [by_id[link] for link in step.links if link in by_id]
    assert len(published) == step.attributes["parity.groups"] == 2
    for rollout_publish in published:
        assert (rollout_publish.service, rollout_publish.name, rollout_publish.kind) == (
            "parity-rollout", "publish", PRODUCER,
        )  # fmt: skip
        group_id = rollout_publish.attributes["parity.group_id"]
        assert rollout_publish.attributes["parity.weight_version"] <= version - 1
        # The group's life on the rollout side is one trace: rollout_group > generate, score, publish.
        group = parent(rollout_publish)
        assert group.name == "rollout_group" and group.attributes["parity.group_id"] == group_id
        siblings = {s.name: s for s in spans if s.trace_id == group.trace_id and s.parent_id == group.span_id}
        assert {"generate", "score", "publish"} <= set(siblings)
        assert siblings["generate"].attributes["parity.group_id"] == group_id
        assert "parity.weight_version" in siblings["generate"].attributes
        # The trainer's consume span links to the same producer span (messaging conventions).
        consumes = [c for c in find("parity-trainer", "consume") if key(rollout_publish) in c.links]
        assert consumes, f"no consume span links to the publish of {group_id}"
        for consume in consumes:  # one per delivery (a redelivered entry is consumed again)
            assert consume.kind == CONSUMER and consume.attributes["parity.group_id"] == group_id
            assert consume.parent_id == "", "a consumer links to its producer; it is not its child"


def test_rollout_measurements_are_nan_until_measured_not_zero() -> None:
    """Queue depth, weight version and tokens/s read NaN before the actor, the engine or a second
    rate sample measured them: a 0 would read as an empty queue, version 0, an idle engine."""
    import math
    import subprocess
    import sys

    code = (
        "import rollout.metrics\n"
        "from prometheus_client import generate_latest\n"
        "print(generate_latest().decode())\n"
    )
    text = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("parity_rollout_")
    }
    for name in (
        "parity_rollout_queue_depth",
        "parity_rollout_weight_version",
        "parity_rollout_tokens_per_second",
    ):
        assert math.isnan(values[name]), (name, values[name])

    from rollout.metrics import TokenRate

    rate = TokenRate()
    rate.add(500)
    assert math.isnan(rate.tick())  # one sample: no interval yet
    time.sleep(0.05)
    rate.add(100)
    assert rate.tick() > 0
