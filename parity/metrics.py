"""Prometheus exposition for every service.

Each service defines its own metrics next to the code that updates them (names: `parity_` prefix,
`_total` for counters, `_seconds`/`_bytes` units, no high-cardinality labels) and calls
`serve_metrics(config.metrics_port, config.host)` once at startup.
"""

from __future__ import annotations


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Start /metrics on `port` (0 picks a free one, -1 disables). Returns the bound port or -1."""
    if port < 0:
        return -1
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return int(server.server_address[1])
