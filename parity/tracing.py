"""OpenTelemetry tracing with zero cost when off.

Invariants:
- Off by default. `init(service_name)` turns tracing on only when `OTEL_TRACES_EXPORTER` is `otlp`
  or `console` and `OTEL_SDK_DISABLED` is not `true` (or when a test passes `exporter=`). Off,
  `span()` returns one shared no-op context manager, `current_traceparent()` returns "", the gRPC
  interceptor lists are empty, and the SDK and the gRPC instrumentation are never imported.
- On, the OTLP exporter reads the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
  `OTEL_EXPORTER_OTLP_PROTOCOL` grpc or http/protobuf, `OTEL_SERVICE_NAME`,
  `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, ...).
- A rollout entry in Redis carries the W3C `traceparent` of its `publish` span. The trainer's
  `consume` and `train_step` spans *link* to it (messaging semantic conventions: a consumer span
  batches many messages, so it links to their producers instead of becoming a child of one).
- gRPC calls are traced by opentelemetry-instrumentation-grpc's interceptors, which carry the
  context in call metadata: the trainer's `publish_version` is the parent of the broadcast
  service's spans for that version, and a `broadcast_transfer` is the parent of the rollout
  worker's `UpdateWeights` server span and its `swap`. Health checks are not traced.

Usage:
    tracing.init("parity-rollout")
    with tracing.span("publish", {ATTR_GROUP_ID: gid}, kind="producer"):
        queue.publish(group, traceparent=tracing.current_traceparent())
    with tracing.span("consume", links_from=[entry_tp, ...], kind="consumer"): ...
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from opentelemetry import propagate, trace

SpanKindName = Literal["internal", "server", "client", "producer", "consumer"]

# Attribute names shared by the three services (documented in docs/observability.md).
ATTR_WEIGHT_VERSION = "parity.weight_version"
ATTR_MIN_VERSION = "parity.min_weight_version"
ATTR_MAX_VERSION = "parity.max_weight_version"
ATTR_GROUP_ID = "parity.group_id"
ATTR_TOKENS = "parity.tokens"
ATTR_LAG = "parity.lag"
ATTR_STEP = "parity.step"
ATTR_BYTES = "parity.bytes"
# Messaging semantic conventions (Redis Streams is the messaging system).
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_OPERATION_TYPE = "messaging.operation.type"
MESSAGING_OPERATION_NAME = "messaging.operation.name"
MESSAGING_MESSAGE_ID = "messaging.message.id"
MESSAGING_BATCH_COUNT = "messaging.batch.message_count"

_HEALTH_SERVICE = "grpc.health.v1.Health"
_NOOP = contextlib.nullcontext(trace.INVALID_SPAN)

MAX_LINKS = 2048  # links a span keeps (the SDK keeps 128): above run.groups_per_step's 1024
_enabled = False
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider when enabled


def enabled() -> bool:
    return _enabled


def init(service_name: str, exporter: Any = None) -> bool:
    """Install a tracer provider for this process; returns whether tracing is on.

    `exporter` (a SpanExporter, e.g. InMemorySpanExporter) forces tracing on with synchronous
    export; tests use it. Calling `init` again replaces the provider used by `span()`.
    """
    global _enabled, _provider
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if exporter is None and (disabled or choice not in {"otlp", "console"}):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME wins over our default.
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    # train_step links every rollout group of its batch: up to run.groups_per_step (1024), past
    # the SDK's default of 128 links a span
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_links=MAX_LINKS))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif choice == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        )
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if _provider is None:
        # The global provider can be set once per process; instrumentations that look it up find it.
        trace.set_tracer_provider(provider)
    elif _provider is not provider:
        _provider.shutdown()
    _provider = provider
    _enabled = True
    return True


def shutdown() -> None:
    """Flush pending spans and turn tracing off (the SDK also flushes at interpreter exit)."""
    global _enabled
    if _provider is not None:
        _provider.force_flush()
    _enabled = False


def _tracer() -> trace.Tracer:
    return _provider.get_tracer("parity")


def context_from(traceparent: str) -> Any:
    """An OpenTelemetry Context whose current span is the one `traceparent` names."""
    return propagate.extract({"traceparent": traceparent})


def span_context_from(traceparent: str) -> trace.SpanContext:
    """The remote SpanContext in a W3C traceparent; invalid when `traceparent` is empty or malformed."""
    if not traceparent:
        return trace.INVALID_SPAN_CONTEXT
    return trace.get_current_span(context_from(traceparent)).get_span_context()


def links(traceparents: Sequence[str], attributes: Mapping[str, Any] | None = None) -> list[trace.Link]:
    """One link per valid traceparent (duplicates kept once); malformed ones are skipped."""
    result: list[trace.Link] = []
    seen: set[tuple[int, int]] = set()
    for tp in traceparents:
        ctx = span_context_from(tp)
        key = (ctx.trace_id, ctx.span_id)
        if ctx.is_valid and key not in seen:
            seen.add(key)
            result.append(trace.Link(ctx, attributes=dict(attributes or {})))
    return result


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    links_from: Sequence[str] = (),
    kind: SpanKindName = "internal",
    parent_traceparent: str = "",
) -> contextlib.AbstractContextManager[trace.Span]:
    """A span named `name`, current inside the `with` block.

    `links_from` are traceparents this span links to (consumer side of a message queue);
    `parent_traceparent` makes the span a child of a remote span instead of the current one.
    """
    if not _enabled:
        return _NOOP
    return _tracer().start_as_current_span(
        name,
        context=context_from(parent_traceparent) if parent_traceparent else None,
        kind=getattr(trace.SpanKind, kind.upper()),
        attributes=dict(attributes or {}),
        links=links(links_from),
    )


def fail(message: str) -> None:
    """Mark the current span failed with `message`: for an error the code caught and answered
    (a failed transfer, a refused update), which would otherwise leave the span green."""
    if _enabled:
        from opentelemetry.trace import Status, StatusCode

        current = trace.get_current_span()
        current.set_status(Status(StatusCode.ERROR, message[:1000]))
        current.add_event("error", {"message": message[:1000]})


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Add attributes to the current span (known only after the work, e.g. token counts)."""
    if _enabled:
        trace.get_current_span().set_attributes(dict(attributes))


def current_traceparent() -> str:
    """The W3C traceparent of the current span, or "" when tracing is off."""
    if not _enabled:
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def messaging_attributes(
    operation: Literal["send", "receive", "process"],
    destination: str,
    message_id: str = "",
    batch_count: int = 0,
) -> dict[str, Any]:
    """Messaging semantic-convention attributes for a Redis Streams producer/consumer span."""
    attrs: dict[str, Any] = {
        MESSAGING_SYSTEM: "redis",
        MESSAGING_DESTINATION: destination,
        MESSAGING_OPERATION_TYPE: operation,
        MESSAGING_OPERATION_NAME: {"send": "XADD", "receive": "XREADGROUP", "process": "process"}[operation],
    }
    if message_id:
        attrs[MESSAGING_MESSAGE_ID] = message_id
    if batch_count:
        attrs[MESSAGING_BATCH_COUNT] = batch_count
    return attrs


def _not_health(call_details: Any) -> bool:
    method = getattr(call_details, "method", "") or ""
    if isinstance(method, bytes):  # aio client call details carry bytes (grpc/grpc#31092)
        method = method.decode()
    return not method.lstrip("/").startswith(_HEALTH_SERVICE)


def server_interceptors() -> list[Any]:
    """aio server interceptors that trace every RPC but health checks; [] when tracing is off."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider, filter_=_not_health)]


def client_interceptors() -> list[Any]:
    """aio client interceptors that trace calls and propagate context; [] when tracing is off."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=_provider, filter_=_not_health))


def instrument_channel(chan: Any) -> Any:
    """Wrap a synchronous `grpc.Channel` so its calls are traced; the channel itself when off."""
    if not _enabled:
        return chan
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    return intercept_channel(chan, client_interceptor(tracer_provider=_provider, filter_=_not_health))
