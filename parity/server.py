"""gRPC server bootstrap shared by the three services.

Every server: binds to the configured host (loopback by default), registers grpc.health.v1 and
server reflection, and guards weight-changing methods with a shared token. The token check is an
interceptor, so a service cannot forget it: when a token is configured, every method listed in
`protected_methods` needs `authorization: Bearer <token>` metadata, and off loopback a token is
mandatory (`ServiceConfig.check_security`).

Every server also has the one error boundary (`ErrorBoundaryInterceptor`, innermost in the chain):
it decodes the request itself, so malformed protobuf bytes and invalid UTF-8 answer
INVALID_ARGUMENT instead of gRPC's "Unexpected DecodeError" (UNKNOWN), and it maps whatever a
handler raises through `parity.errors.status_for`. An exception nothing maps is a bug: the client
gets INTERNAL with a trace id and the log gets the traceback under the same id. No handler's
exception reaches a client as UNKNOWN. Details are bounded (`parity.errors.bounded`), those a
handler passes to `context.abort` itself too, so a refusal quoting a huge value still arrives as
itself and not as the client's "metadata size exceeds" RESOURCE_EXHAUSTED. Received messages are
capped at `max_message_bytes` (RESOURCE_EXHAUSTED from gRPC itself above it).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from parity import tracing
from parity.config import ServiceConfig
from parity.errors import bounded, invalid, status_for

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the shared token."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to protected methods that lack the shared token (UNAUTHENTICATED)."""

    def __init__(self, token: str, protected_methods: Iterable[str]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._protected = frozenset(protected_methods)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        if handler_call_details.method not in self._protected:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = str(metadata.get(AUTH_METADATA_KEY, "")).encode()
        if hmac.compare_digest(given, self._expected):
            return await continuation(handler_call_details)
        method = handler_call_details.method

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"authorization: {method} changes the service's state (weights, training, membership) "
                "and needs 'authorization: Bearer <token>' metadata",
            )

        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def _trace_id() -> str:
    """The current trace id when tracing is on (so the log and the trace agree), else a fresh one."""
    parts = tracing.current_traceparent().split("-")
    return parts[1] if len(parts) == 4 else uuid.uuid4().hex


async def _refuse(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    """Abort the call with the status `exc` maps to; an unmapped exception is logged as a bug."""
    refusal = status_for(exc)
    if refusal is None:
        trace_id = _trace_id()
        log.error("bug in %s (trace id %s): %r", method, trace_id, exc, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (trace id {trace_id})")
    log.debug("%s refused: %s %s", method, refusal.code.name, refusal.details)
    await context.abort(refusal.code, refusal.details, refusal.trailing_metadata())


def _decoder(method: str, deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object]:
    def decode(raw: bytes) -> object:
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            raise invalid(
                "request",
                f"cannot decode the {method} request ({len(raw)} bytes): {type(exc).__name__}: {exc}",
            ) from None

    return decode


class _BoundedDetails:
    """A handler's ServicerContext whose `abort` and `set_details` bound the details they send."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        await self._context.abort(code, bounded(details), trailing_metadata)

    def set_details(self, details: str) -> None:
        self._context.set_details(bounded(details))


class ErrorBoundaryInterceptor(grpc.aio.ServerInterceptor):
    """The one error boundary: request decoding and every handler exception map to a status code.

    It wraps async unary-request handlers (unary-unary coroutines and unary-stream async
    generators), the shape of every Parity RPC; any other handler passes through unchanged.
    """

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        decode = _decoder(method, handler.request_deserializer)
        if not handler.response_streaming and inspect.iscoroutinefunction(handler.unary_unary):
            inner = handler.unary_unary

            async def unary(raw: bytes, context: grpc.aio.ServicerContext):
                try:
                    return await inner(decode(raw), _BoundedDetails(context))
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _refuse(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
        if handler.response_streaming and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def stream(raw: bytes, context: grpc.aio.ServicerContext):
                try:
                    async for item in inner_stream(decode(raw), _BoundedDetails(context)):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _refuse(context, method, exc)

            return grpc.unary_stream_rpc_method_handler(
                stream, response_serializer=handler.response_serializer
            )
        return handler


class GrpcServer:
    """An aio server with health, reflection and auth, bound per `ServiceConfig`."""

    def __init__(
        self,
        config: ServiceConfig,
        service_names: list[str],
        protected_methods: Iterable[str] = (),
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        config.check_security()
        self.config = config
        # Tracing first, so rejected calls are traced too; [] (no cost) when tracing is off.
        chain = [*tracing.server_interceptors(), *interceptors]
        if config.auth_token:
            chain.append(TokenAuthInterceptor(config.auth_token, protected_methods))
        chain.append(ErrorBoundaryInterceptor())  # innermost: it sees the handler's own exceptions
        self.server = grpc.aio.server(
            interceptors=chain,
            options=[
                # gRPC sets SO_REUSEPORT by default: a second service on a taken port would bind it
                # too, and the kernel would spread calls between the two. One port, one service.
                ("grpc.so_reuseport", 0),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", config.max_message_bytes),
            ],
        )
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    async def start(self) -> int:
        """Bind and start; returns the bound port. Services report NOT_SERVING until `set_serving`."""
        host = self.config.host
        bind_host = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
        try:
            self.port = self.server.add_insecure_port(f"{bind_host}:{self.config.port}")
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            raise RuntimeError(
                f"port: could not bind {host}:{self.config.port} (in use by another process, or not "
                "an address of this host)"
            )
        await self.server.start()
        await self.set_serving(False)
        log.info("gRPC listening on %s:%d (%s)", host, self.port, ", ".join(self.service_names))
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result
        if serving and self.config.port_file:
            path = Path(self.config.port_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(path)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


def install_shutdown_handlers(on_shutdown: Callable[[], Awaitable[None]]) -> asyncio.Event:
    """SIGTERM/SIGINT set the returned event and schedule `on_shutdown` once."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    tasks: list[asyncio.Task] = []

    def _handle() -> None:
        if not stopped.is_set():
            stopped.set()
            tasks.append(loop.create_task(on_shutdown()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _handle)
    return stopped


# A service that restarts at its address is reached again within ~2 s: gRPC's default reconnect
# backoff grows to 120 s, and a channel in backoff fails every call at once with UNAVAILABLE.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Every client channel to a Parity service, sync or aio: large messages and the reconnect backoff.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    *RECONNECT_OPTIONS,
]


def channel(address: str, token: str = "") -> grpc.aio.Channel:
    """An aio channel to a Parity service (large messages allowed)."""
    del token  # tokens travel as per-call metadata, see `bearer`
    return grpc.aio.insecure_channel(
        address,
        interceptors=tracing.client_interceptors() or None,
        options=CHANNEL_OPTIONS,
    )
