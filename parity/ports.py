"""Free TCP ports for services, rendezvous stores and tests that bind their own.

A port found free can be taken by someone else before the caller binds it; callers that start a
child on it retry on another port when that happens (see `parity.procs.start_redis`).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
