"""The TCP addresses a process listens on, read from /proc (Linux): for tests of what a service binds."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket process `pid` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    # /proc/net/tcp{,6}: each 32-bit word in host (little-endian) byte order
    raw = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def off_loopback(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket of `pids` not on a loopback address."""
    return [
        (pid, address, port)
        for pid in pids
        for address, port in listening(pid)
        if not ipaddress.ip_address(address).is_loopback
    ]
