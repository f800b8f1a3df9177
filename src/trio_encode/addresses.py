"""IP address forms that hide another address, shared by every address rule of the package.

An IPv6 address can carry an IPv4 one: IPv4-mapped (``::ffff:10.1.2.3``, the same host as
``10.1.2.3``, so it is matched as that), and the translation forms (NAT64 ``64:ff9b::/96`` and
``64:ff9b:1::/48``, 6to4 ``2002::/16``, the deprecated IPv4-compatible ``::a.b.c.d``), which a
gateway turns into a connection to an IPv4 host the rules never saw. Python's ``is_global``
calls most of the translation forms global, so a rule that trusts it alone lets a client name
a private IPv4 host through them.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_TRANSLATING = tuple(
    ipaddress.IPv6Network(network)
    for network in ("64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96")
)
_NOT_TRANSLATED = (ipaddress.IPv6Address("::"), ipaddress.IPv6Address("::1"))


def unwrap(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv4-mapped IPv6 address stands for; any other address as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def translates_to_ipv4(address: IPAddress) -> bool:
    """Whether ``address`` is a NAT64, 6to4 or IPv4-compatible form (refused by every rule)."""
    if not isinstance(address, ipaddress.IPv6Address) or address in _NOT_TRANSLATED:
        return False
    return any(address in network for network in _TRANSLATING)


def parse(host: str) -> IPAddress | None:
    """``host`` as an address (brackets and an IPv6 zone dropped); None for a host name."""
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return None
