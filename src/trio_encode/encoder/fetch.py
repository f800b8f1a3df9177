"""Fetching ``http(s)://`` image items, without letting a client reach where it should not.

An encode server usually sits inside a cluster, next to metadata services and admin ports that
the public must never reach. A URL in ``mm_items`` is chosen by whoever sent the request, so a
server that fetched it blindly would be a request-forgery proxy into that network. Hence:

- fetching is off unless the operator turns it on;
- when a host allowlist is set, only those host names are fetched;
- every address a name resolves to must be public (not private, loopback, link-local,
  multicast or reserved) unless it lies in a network the operator listed; the connection then
  goes to the address that was checked (the name is resolved once, so a second, different DNS
  answer cannot slip past the check), with the name kept for ``Host`` and TLS;
- redirects are followed by hand, each hop checked the same way, up to a limit;
- NAT64, 6to4 and IPv4-compatible IPv6 forms are refused (a gateway would turn them into a
  connection to an IPv4 host no rule saw); IPv4-mapped ones are checked as the IPv4 address;
- the body is asked for and accepted only uncompressed (``Accept-Encoding: identity``; any
  ``Content-Encoding`` is refused) and counted as it arrives off the wire, so a small
  compressed answer can never inflate past the byte limit; the whole fetch has a time limit;
- proxies from the environment are ignored (a proxy would connect on our behalf, unchecked).

Every refusal and failure is an :class:`InvalidInput` that names the URL and the reason.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import trio

from trio_encode.addresses import IPAddress, IPNetwork, translates_to_ipv4, unwrap
from trio_encode.encoder.images import ImageTooBig
from trio_encode.errors import InvalidInput

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SCHEMES = ("http://", "https://")


def is_remote(item: str) -> bool:
    """Whether an ``mm_items`` entry is an ``http(s)://`` URL (for this module to fetch)."""
    return item[:8].lower().startswith(_SCHEMES)


@dataclass(frozen=True)
class FetchPolicy:
    """What a fetch may do; built from the encoder settings."""

    enabled: bool = False
    hosts: frozenset[str] = frozenset()
    """Host names that may be fetched (lower case); empty means any public host."""
    private_networks: tuple[IPNetwork, ...] = ()
    """Non-public networks that fetches may still reach."""
    max_bytes: int = 20 << 20
    timeout: float = 10.0
    """Seconds for the whole fetch, redirects included."""
    max_redirects: int = 3

    @classmethod
    def build(
        cls,
        *,
        enabled: bool,
        hosts: Sequence[str],
        private_networks: Sequence[str],
        max_bytes: int,
        timeout: float,
        max_redirects: int,
    ) -> FetchPolicy:
        """Parse the settings' strings; a malformed network is a ``ValueError``."""
        networks = tuple(ipaddress.ip_network(net, strict=False) for net in private_networks)
        return cls(
            enabled=enabled,
            hosts=frozenset(host.lower().rstrip(".") for host in hosts),
            private_networks=networks,
            max_bytes=max_bytes,
            timeout=timeout,
            max_redirects=max_redirects,
        )

    def address_allowed(self, address: IPAddress) -> bool:
        address = unwrap(address)
        if any(address in network for network in self.private_networks):
            return True
        if translates_to_ipv4(address):
            return False
        return address.is_global and not address.is_multicast


class RemoteFetcher:
    """Fetches image URLs under a :class:`FetchPolicy`, on Trio, with httpx."""

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy

    async def fetch(self, url: str, *, max_bytes: int | None = None) -> bytes:
        """The body of ``url`` (following allowed redirects), or :class:`InvalidInput`;
        at most ``max_bytes`` (default: the policy's) are read."""
        if not self.policy.enabled:
            raise InvalidInput(
                f"http(s) URLs are not fetched by this server ({_short(url)}); send the image "
                "inline as a data: URI, or start the server with --remote-fetch"
            )
        limit = (
            self.policy.max_bytes if max_bytes is None else min(max_bytes, self.policy.max_bytes)
        )
        with trio.move_on_after(self.policy.timeout) as timer:
            try:
                return await self._follow(url, limit)
            except (UnicodeError, OverflowError) as exc:
                # A host IDNA rejects (an empty or overlong label, a bad ``xn--`` label) raises
                # UnicodeError out of httpx or getaddrinfo, a port past a C long OverflowError,
                # for the URL and for every redirect's Location alike.
                raise InvalidInput(f"cannot fetch {_short(url)}: {exc}") from None
        assert timer.cancelled_caught
        raise InvalidInput(f"fetching {_short(url)} took longer than {self.policy.timeout:g} s")

    async def _follow(self, url: str, limit: int) -> bytes:
        current = url
        for _hop in range(self.policy.max_redirects + 1):
            target = await self._checked(current)
            body, location = await self._get(current, target, limit)
            if location is None:
                return body
            current = str(httpx.URL(current).join(location))
        raise InvalidInput(
            f"fetching {_short(url)} was redirected more than {self.policy.max_redirects} times"
        )

    async def _checked(self, url: str) -> IPAddress:
        """The address to connect to for ``url``, after every rule has passed."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise InvalidInput(f"malformed URL {_short(url)}: {exc}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise InvalidInput(f"only http(s) URLs with a host may be fetched: {_short(url)}")
        host = parsed.host.lower().rstrip(".")
        if self.policy.hosts and host not in self.policy.hosts:
            raise InvalidInput(f"host {host!r} is not on this server's fetch allowlist")
        addresses = await _resolve(host, parsed.port or (443 if parsed.scheme == "https" else 80))
        refused = [a for a in addresses if not self.policy.address_allowed(a)]
        if refused:
            raise InvalidInput(
                f"host {host!r} resolves to {refused[0]}, a non-public address this server "
                "does not fetch from"
            )
        return addresses[0]

    async def _get(self, url: str, address: IPAddress, limit: int) -> tuple[bytes, str | None]:
        """One request to ``address``: the body, or the ``Location`` of a redirect."""
        parsed = httpx.URL(url)
        pinned = parsed.copy_with(host=str(address))
        headers = {
            "Host": parsed.netloc.decode("ascii"),
            "Accept": "image/*",
            "Accept-Encoding": "identity",
        }
        extensions = {"sni_hostname": parsed.host}
        # A fresh client per request: a pooled TLS connection checked for one name must not
        # serve another name that happens to resolve to the same address.
        try:
            async with (
                httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=None) as client,
                client.stream("GET", pinned, headers=headers, extensions=extensions) as response,
            ):
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise InvalidInput(f"{_short(url)} redirected without a Location")
                    return b"", location
                if response.status_code != 200:
                    raise InvalidInput(f"fetching {_short(url)} got HTTP {response.status_code}")
                return await _read(url, response, limit), None
        except httpx.HTTPError as exc:
            raise InvalidInput(f"cannot fetch {_short(url)}: {_reason(exc, parsed)}") from None


async def _read(url: str, response: httpx.Response, limit: int) -> bytes:
    """The body as sent: never decompressed (any ``Content-Encoding`` but identity is
    refused before a byte is read), counted raw, refused past ``limit``."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidInput(
            f"{_short(url)} answered with Content-Encoding {encoding!r}; images are fetched "
            "only uncompressed (Accept-Encoding: identity)"
        )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ImageTooBig(_too_big(url, f"{declared} bytes", limit))
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise ImageTooBig(_too_big(url, f"more than {limit} bytes", limit))
    if not body:
        raise InvalidInput(f"fetching {_short(url)} returned no bytes")
    return bytes(body)


async def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidInput(f"cannot resolve host {host!r}: {exc}") from None
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise InvalidInput(f"host {host!r} has no address")
    return addresses


def _reason(exc: BaseException, url: httpx.URL) -> str:
    """Why a fetch failed, in words: httpx's own message is often empty (a TLS handshake
    that fails wraps an empty ``BrokenResourceError`` around the ``SSLError`` that says
    why), so the first non-empty message down the chain of causes is taken."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    tls = next((c for c in chain if isinstance(c, ssl.SSLError)), None)
    if tls is not None and url.scheme == "https":
        hint = " (is it a plain-HTTP server?)" if "WRONG_VERSION_NUMBER" in str(tls) else ""
        return f"TLS handshake failed: {tls.reason or tls}{hint}"
    said = next((str(c) for c in chain if str(c)), "")
    return said or f"{type(exc).__name__} (no message)"


def _too_big(url: str, size: str, limit: int) -> str:
    return f"the image at {_short(url)} is {size}; the limit is {limit} bytes"


def _short(url: str) -> str:
    """The URL as shown in an error (long ones cut, so a message stays readable)."""
    return url if len(url) <= 120 else url[:117] + "..."
