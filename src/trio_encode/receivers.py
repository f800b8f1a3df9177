"""Which receivers ``/send`` may write to: the allow-list of receiver hosts.

A ``/send`` names a ``session_id`` (``host:port`` of a transfer engine) and the server's engine
connects there and writes. Left open, that is a write primitive aimed wherever a caller likes
(and a handshake that tells the listener where the server's memory lies). So a receiver's host
must be one the operator named: an address inside a listed network, or a host name listed as
it is. Loopback is always allowed (ranks on the same host); ``*`` allows any host, for
deployments that guard the engine's network otherwise (the server then warns at start).

Host names are matched as written, never resolved: a name's answer can change between this
check and the engine's own lookup. IPv4-mapped IPv6 addresses are matched as the IPv4 address
they stand for; NAT64, 6to4 and IPv4-compatible forms are refused unless ``*``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from trio_encode.addresses import IPNetwork, parse, translates_to_ipv4, unwrap

ANY = "*"
_LOOPBACK: tuple[IPNetwork, ...] = (
    ipaddress.IPv4Network("127.0.0.0/8"),
    ipaddress.IPv6Network("::1/128"),
)


def receiver_host(session_id: str) -> str:
    """The host of a ``host:port`` session id (an IPv6 address without its brackets)."""
    host = session_id.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def same_host(a: str, b: str) -> bool:
    """Whether two host strings name the same host without resolving either: equal addresses
    (IPv4-mapped unwrapped), equal names ignoring case and a trailing dot, or both this host
    (``localhost`` and loopback addresses)."""
    if _loopback(a) and _loopback(b):
        return True
    address_a, address_b = parse(a), parse(b)
    if address_a is not None and address_b is not None:
        return unwrap(address_a) == unwrap(address_b)
    return a.lower().rstrip(".") == b.lower().rstrip(".")


def _loopback(host: str) -> bool:
    address = parse(host)
    if address is None:
        return host.lower().rstrip(".") == "localhost"
    return unwrap(address).is_loopback


@dataclass(frozen=True)
class ReceiverPolicy:
    """The hosts ``/send`` may write to; build it with :meth:`build`."""

    networks: tuple[IPNetwork, ...] = _LOOPBACK
    names: frozenset[str] = frozenset({"localhost"})
    any_host: bool = False

    @classmethod
    def build(cls, entries: Sequence[str]) -> ReceiverPolicy:
        """From ``allowed_receivers``: CIDR networks, addresses, host names, or ``*``.
        Loopback is always in. A malformed network is a ``ValueError`` naming it."""
        networks = list(_LOOPBACK)
        names = {"localhost"}
        for entry in entries:
            entry = entry.strip()
            if entry == ANY:
                return cls(any_host=True)
            if any(c in entry for c in "/:") or parse(entry) is not None:
                try:
                    networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                except ValueError:
                    raise ValueError(f"{entry!r} is not a CIDR network or address") from None
            elif entry:
                names.add(entry.lower().rstrip("."))
        return cls(tuple(networks), frozenset(names))

    def allows(self, host: str) -> bool:
        if self.any_host:
            return True
        address = parse(host)
        if address is None:
            return host.lower().rstrip(".") in self.names
        if translates_to_ipv4(address):
            return False
        address = unwrap(address)
        return any(address in network for network in self.networks)
