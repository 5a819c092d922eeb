"""OpenTelemetry tracing with zero cost when off.

`init(service_name)` configures a tracer provider from the standard `OTEL_*` variables. Tracing is
on only when `OTEL_TRACES_EXPORTER` is `otlp` or `console` (or when a test installs an exporter via
`init(..., exporter=...)`); otherwise every `span()` is the API's no-op span and costs a function
call. Each rollout entry carries a W3C `traceparent`; consumers *link* to it (messaging semantic
conventions: a consumer span links to the producer span instead of becoming its child).

Usage:
    tracing.init("parity-rollout")
    with tracing.span("generate", {"parity.weight_version": 3}) as sp: ...
    tp = tracing.current_traceparent()                 # store beside the Redis entry
    with tracing.span("consume", links_from=[tp], kind="consumer"): ...
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from opentelemetry import propagate, trace

_enabled = False
SpanKindName = Literal["internal", "server", "client", "producer", "consumer"]


def enabled() -> bool:
    return _enabled


def init(service_name: str, exporter: Any = None) -> bool:
    """Install a tracer provider for this process; returns whether tracing is on."""
    global _enabled
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter is None and choice not in {"otlp", "console"}:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif choice == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


def _links(traceparents: Sequence[str]) -> list[trace.Link]:
    links = []
    for tp in traceparents:
        if not tp:
            continue
        ctx = trace.get_current_span(propagate.extract({"traceparent": tp})).get_span_context()
        if ctx.is_valid:
            links.append(trace.Link(ctx))
    return links


@contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    links_from: Sequence[str] = (),
    kind: SpanKindName = "internal",
    parent_traceparent: str = "",
) -> Iterator[trace.Span]:
    """A span named `name`; `links_from` are traceparents to link to (consumer side)."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    context = propagate.extract({"traceparent": parent_traceparent}) if parent_traceparent else None
    tracer = trace.get_tracer("parity")
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=getattr(trace.SpanKind, kind.upper()),
        attributes=dict(attributes or {}),
        links=_links(links_from),
    ) as current:
        yield current


def current_traceparent() -> str:
    """The W3C traceparent of the current span, or "" when tracing is off."""
    if not _enabled:
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")
