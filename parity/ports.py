"""Free TCP ports for services, rendezvous stores and tests that bind their own.

A port found free can be taken by someone else before the caller binds it. Most takers are the
kernel's own choices: every `bind(port 0)` (a gRPC server on port 0, a store) and every outgoing
connection gets a port from the ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999
by default). So `free_port` draws from below that range, where the kernel never hands out a port of
its own accord: a port it returns can then only be lost to another caller that picks the same one
(a random draw among ~20,000) or to a program that asked for that number itself. Callers that start
a child on a port still retry on another one when it is taken (`parity.procs.start_redis`). Where
there is no room below the range (fewer than `MIN_SPAN` ports between `LOWEST` and it), it asks the
kernel.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # below: the well-known and registered ports other programs expect to own
MIN_SPAN = 1_000
DRAWS = 64
_draw = random.SystemRandom()  # not the `random` module's generator: tests seed that one alike


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now, outside the kernel's ephemeral range when it can
    (module docstring)."""
    low = _ephemeral_low()
    if low - LOWEST >= MIN_SPAN:
        for _ in range(DRAWS):
            port = _draw.randrange(LOWEST, low)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768, Linux's default, when unreadable)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
