"""`parity serve broadcast`: run the weight-broadcast service.

    parity serve broadcast --host 127.0.0.1 --port 0 --backend gloo --data_host 127.0.0.1 \\
        --heartbeat_timeout_s 10 --transfer_timeout_s 60 --bucket_bytes 67108864 --metrics_port -1

It reads the `broadcast` section of the run config (`--field`, `--broadcast.field`,
`PARITY_BROADCAST_<FIELD>`, or a file via `--config`/`PARITY_CONFIG`). It binds to loopback by
default; off loopback it refuses to start without an auth token (PARITY_BROADCAST_AUTH_TOKEN). The TCPStore
for the data groups' rendezvous listens on --data_host:--store_port only (0 picks a port); it is the
only data-plane port the service opens, and the service never joins a data group itself.
With `broadcast.notify_redis` (auto: when run.redis_url is set) it also publishes every version event
to Redis pub/sub for parity/weights/version_watch.py (broadcast/notify.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from parity.config import ParityConfig
from parity.config.broadcast import BroadcastConfig
from parity.config.entry import entrypoint

log = logging.getLogger("parity.broadcast")


async def serve(config: BroadcastConfig, notify: tuple[str, str] | None = None) -> int:
    """Serve until a shutdown signal. `notify` = (redis_url, stream): publish events to Redis."""
    from parity import metrics, tracing
    from parity.server import GrpcServer, install_shutdown_handlers
    from parity.v1 import broadcast_pb2_grpc
    from parity.weights.rendezvous import serve_store
    from services.broadcast.service import PROTECTED_METHODS, SERVICE, WeightBroadcastService

    tracing.init("parity-broadcast")
    server = GrpcServer(config, [SERVICE], protected_methods=PROTECTED_METHODS)
    store = serve_store(
        config.data_bind_host or config.data_host, config.store_port, config.transfer_timeout_s
    )
    store_port = store.port
    service = WeightBroadcastService(config, store_port)
    broadcast_pb2_grpc.add_WeightBroadcastServiceServicer_to_server(service, server.server)
    await server.start()
    metrics_port = metrics.serve_metrics(config.metrics_port, config.host)
    reaper = asyncio.ensure_future(service.reap_forever())
    notifier = None
    if notify is not None:
        from broadcast.notify import RedisNotifier

        notifier = asyncio.ensure_future(RedisNotifier(service.events, *notify).run())

    async def shutdown() -> None:
        reaper.cancel()
        if notifier is not None:
            notifier.cancel()
        await service.close()
        await server.stop(2.0)

    stopped = install_shutdown_handlers(shutdown)
    await server.set_serving(True)
    log.info(
        "broadcast serving on %s:%d (backend %s, store %s:%d bound on %s, metrics %s, events to redis %s)",
        config.host,
        server.port,
        config.backend,
        config.data_host,
        store_port,
        config.data_bind_host or config.data_host,
        metrics_port,
        f"channels {notify[1]}:versions:*" if notify else "off",
    )
    await stopped.wait()
    await server.server.wait_for_termination()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    def body(config: ParityConfig) -> int:
        mode, url = config.broadcast.notify_redis, config.run.redis_url
        if mode == "on" and not url:
            print(
                "parity serve broadcast: error: broadcast.notify_redis: 'on' needs run.redis_url "
                "(or set it to auto/off)",
                file=sys.stderr,
            )
            return 2
        notify = (url, config.run.stream) if url and mode != "off" else None
        return asyncio.run(serve(config.broadcast, notify))

    return entrypoint(
        "parity serve broadcast", "broadcast", list(sys.argv[1:] if argv is None else argv), body
    )


if __name__ == "__main__":
    sys.exit(main())
