"""parity.ports.free_port draws below the kernel's ephemeral range, so that no port the kernel hands
out by itself (a bind to port 0, an outgoing connection) can take the port between the draw and the
caller's bind: the race that failed a fresh-clone suite run (a service's metrics port, "Address
already in use")."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from parity import ports


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    drawn = [ports.free_port() for _ in range(200)]
    assert all(ports.LOWEST <= port < low for port in drawn), (low, min(drawn), max(drawn))
    assert len(set(drawn)) > 150  # random draws, not one sequence every process repeats
    for port in drawn[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when returned (nothing else here took it since)


def test_kernel_chosen_ports_never_land_on_a_drawn_port() -> None:
    drawn = {ports.free_port() for _ in range(50)}
    held = []
    try:
        for _ in range(500):  # what other processes do meanwhile: bind to port 0
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        assert not drawn & {sock.getsockname()[1] for sock in held}
    finally:
        for sock in held:
            sock.close()


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_535)
        draws = iter([busy, busy, *range(20_001, 20_060)])
        monkeypatch.setattr(ports._draw, "randrange", lambda _a, _b: next(draws))
        port = ports.free_port()
    assert port != busy and 20_001 <= port < 20_060


def test_without_room_below_the_range_the_kernel_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("10500\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", narrow)
    assert ports._ephemeral_low() == 10_500
    monkeypatch.setattr(ports._draw, "randrange", lambda _a, _b: pytest.fail("drew with no room to draw"))
    assert 0 < ports.free_port() <= 65_535
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports._ephemeral_low() == 32_768


def test_a_second_service_on_a_taken_port_fails_to_start() -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: two services on one port would both start,
    and the kernel would hand each call to either. The second must fail instead."""
    import asyncio

    from parity.config import ServiceConfig
    from parity.server import GrpcServer

    async def scenario() -> str:
        port = ports.free_port()
        first = GrpcServer(ServiceConfig(port=port), ["parity.test.First"])
        second = GrpcServer(ServiceConfig(port=port), ["parity.test.Second"])
        assert await first.start() == port
        try:
            await second.start()
            return f"the second server bound {second.port} too"
        except RuntimeError as exc:
            return str(exc)
        finally:
            await second.server.stop(0)
            await first.stop(0)

    outcome = asyncio.run(scenario())
    assert "could not bind" in outcome, outcome
