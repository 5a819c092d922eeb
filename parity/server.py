"""gRPC server bootstrap shared by the three services.

Every server: binds to the configured host (loopback by default), registers grpc.health.v1 and
server reflection, and guards weight-changing methods with a shared token. The token check is an
interceptor, so a service cannot forget it: when a token is configured, every method listed in
`protected_methods` needs `authorization: Bearer <token>` metadata, and off loopback a token is
mandatory (`ServiceConfig.check_security`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from parity import tracing
from parity.config import ServiceConfig

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
                f"{method} changes model weights and needs 'authorization: Bearer <token>' metadata",
            )

        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


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
        self.server = grpc.aio.server(
            interceptors=chain,
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
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
        self.port = self.server.add_insecure_port(f"{bind_host}:{self.config.port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{self.config.port}")
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


def channel(address: str, token: str = "") -> grpc.aio.Channel:
    """An aio channel to a Parity service (large messages allowed)."""
    del token  # tokens travel as per-call metadata, see `bearer`
    return grpc.aio.insecure_channel(
        address,
        interceptors=tracing.client_interceptors() or None,
        options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ],
    )
