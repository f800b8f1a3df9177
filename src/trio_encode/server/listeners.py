"""The TCP ports this process listens on, read from ``/proc`` (Linux), to say which of them
are open on every interface.

Mooncake's transfer engine (0.3.13) binds its handshake port to ``0.0.0.0`` and its TCP
transport port to ``[::]`` (dual stack) whatever address it is given: the address only names
where peers reach it. Whoever reaches those ports can read and write every byte the engine has
registered (the arena, embeddings in flight), so the server finds them at start and logs them,
for the operator to firewall. Elsewhere than Linux nothing is found and nothing is logged.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"
WILDCARDS = frozenset({"0.0.0.0", "::"})


def listening_sockets(proc: Path = Path("/proc/self")) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket this process listens on; empty without /proc."""
    try:
        owned = {
            target[8:-1]
            for name in os.listdir(proc / "fd")
            if (target := _readlink(proc / "fd" / name)).startswith("socket:[")
        }
    except OSError:
        return set()
    found = set()
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN or fields[9] not in owned:
                continue
            address, _, port = fields[1].partition(":")
            found.add((_address(address, v6), int(port, 16)))
    return found


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _address(hex_address: str, v6: bool) -> str:
    """The kernel's hex form (32-bit words in host order, little-endian here) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words))
