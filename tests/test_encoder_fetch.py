"""Fetching ``http(s)://`` items: off by default, no private addresses, bounded in bytes, time
and redirects; against a real HTTP server on loopback (listed as an allowed network only where
a test says so)."""

from __future__ import annotations

import ipaddress
from functools import partial

import pytest
import torch
import trio

from support.fake_encoder import FakeBackend, inline
from support.web_server import web_server
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder.fetch import FetchPolicy, RemoteFetcher, is_remote
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.errors import InvalidInput
from trio_encode.testing.images import image_uri, solid_image

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


PNG = solid_image(8, 8)


def fetcher(**policy: object) -> RemoteFetcher:
    defaults: dict[str, object] = {"enabled": True, "max_bytes": 1 << 20, "timeout": 5.0}
    return RemoteFetcher(FetchPolicy(**(defaults | policy)))  # type: ignore[arg-type]


def test_only_http_and_https_items_are_remote() -> None:
    assert is_remote("http://x/a.png")
    assert is_remote("HTTPS://x/a.png")
    assert not is_remote("data:image/png;base64,AAAA")
    assert not is_remote("file:///etc/passwd")
    assert not is_remote("photos/a.png")


async def test_fetching_is_off_unless_enabled() -> None:
    async with web_server() as web:
        web.routes["/a.png"] = (200, {}, PNG)
        with pytest.raises(InvalidInput, match="not fetched by this server"):
            await fetcher(enabled=False, private_networks=LOOPBACK).fetch(web.url("/a.png"))
        assert web.requests == []


async def test_a_listed_network_is_fetched_with_the_name_as_host() -> None:
    async with web_server() as web:
        web.routes["/a.png"] = (200, {"Content-Type": "image/png"}, PNG)
        got = await fetcher(private_networks=LOOPBACK).fetch(web.url("/a.png", host="localhost"))
        assert got == PNG
        assert web.requests == [("/a.png", f"localhost:{web.port}")]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
async def test_loopback_is_refused_unless_listed(host: str) -> None:
    async with web_server() as web:
        web.routes["/a.png"] = (200, {}, PNG)
        with pytest.raises(InvalidInput, match="non-public address"):
            await fetcher().fetch(web.url("/a.png", host=host))
        assert web.requests == []


@pytest.mark.parametrize(
    "address", ["10.1.2.3", "192.168.0.1", "172.16.0.1", "169.254.169.254", "0.0.0.0", "::1"]
)
async def test_private_link_local_and_unspecified_addresses_are_refused(address: str) -> None:
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(InvalidInput, match="non-public address"):
        await fetcher(private_networks=LOOPBACK).fetch(f"http://{host}/latest/meta-data")


def test_public_addresses_are_allowed_and_multicast_is_not() -> None:
    policy = FetchPolicy(enabled=True)
    assert policy.address_allowed(ipaddress.ip_address("93.184.216.34"))
    assert policy.address_allowed(ipaddress.ip_address("2606:2800:220:1::1"))
    assert not policy.address_allowed(ipaddress.ip_address("224.0.0.1"))
    assert not policy.address_allowed(ipaddress.ip_address("fe80::1"))
    assert not policy.address_allowed(ipaddress.ip_address("fd00::1"))


async def test_a_host_allowlist_refuses_every_other_host() -> None:
    async with web_server() as web:
        web.routes["/a.png"] = (200, {}, PNG)
        only = fetcher(private_networks=LOOPBACK, hosts=frozenset({"images.example"}))
        with pytest.raises(InvalidInput, match="not on this server's fetch allowlist"):
            await only.fetch(web.url("/a.png"))
        allowed = fetcher(private_networks=LOOPBACK, hosts=frozenset({"localhost"}))
        assert await allowed.fetch(web.url("/a.png", host="LOCALHOST")) == PNG


async def test_bodies_past_the_byte_limit_are_refused() -> None:
    async with web_server() as web:
        web.routes["/declared"] = (200, {}, b"x" * 2000)
        web.routes["/undeclared"] = (200, {"Content-Length": "10"}, b"x" * 10)
        small = fetcher(private_networks=LOOPBACK, max_bytes=1000)
        with pytest.raises(InvalidInput, match="2000 bytes; the limit is 1000"):
            await small.fetch(web.url("/declared"))
        tiny = fetcher(private_networks=LOOPBACK, max_bytes=5)
        with pytest.raises(InvalidInput, match="the limit is 5 bytes"):
            await tiny.fetch(web.url("/undeclared"))


async def test_redirects_are_followed_up_to_the_limit_each_hop_checked() -> None:
    async with web_server() as web:
        web.routes["/a.png"] = (200, {}, PNG)
        for n in range(1, 4):
            target = "/a.png" if n == 1 else f"/hop{n - 1}"
            web.routes[f"/hop{n}"] = (302, {"Location": target}, b"")
        web.routes["/to-metadata"] = (302, {"Location": "http://169.254.169.254/x"}, b"")
        policy = fetcher(private_networks=LOOPBACK, max_redirects=2)
        assert await policy.fetch(web.url("/hop2")) == PNG
        with pytest.raises(InvalidInput, match="redirected more than 2 times"):
            await policy.fetch(web.url("/hop3"))
        with pytest.raises(InvalidInput, match=r"169\.254\.169\.254, a non-public address"):
            await policy.fetch(web.url("/to-metadata"))


async def test_a_slow_server_is_cut_off_at_the_time_limit() -> None:
    async with web_server() as web:
        web.hang.add("/slow")
        started = trio.current_time()
        with pytest.raises(InvalidInput, match=r"took longer than 0\.3 s"):
            await fetcher(private_networks=LOOPBACK, timeout=0.3).fetch(web.url("/slow"))
        assert trio.current_time() - started < 3.0


async def test_an_error_status_is_refused_with_the_status() -> None:
    async with web_server() as web:
        with pytest.raises(InvalidInput, match="got HTTP 404"):
            await fetcher(private_networks=LOOPBACK).fetch(web.url("/missing.png"))


async def test_the_encoder_fetches_urls_in_order_and_decodes_them_under_the_same_limits() -> None:
    """A request mixing a URL and an inline image; then a fetched image too large in pixels
    is refused from its header, as soon as it is fetched, exactly as an inline one would be."""
    red, blue = solid_image(8, 8, (255, 0, 0)), solid_image(8, 8, (0, 0, 255))
    settings = EncoderSettings(
        warmup=False,
        cache_bytes=0,
        max_image_pixels=100,
        remote_fetch=True,
        remote_private_networks=("127.0.0.0/8",),
    )
    async with web_server() as web:
        web.routes["/red.png"] = (200, {}, red)
        web.routes["/huge.png"] = (200, {}, solid_image(20, 20))
        encoder = ImageEncoder(FakeBackend(), settings, run_decode=inline, run_forward=inline)
        async with trio.open_nursery() as nursery:
            await nursery.start(encoder.run)
            images = await encoder.load_items([web.url("/red.png"), image_uri(blue)])
            assert images == [red, blue]
            rows = (await encoder.encode(images)).tensor
            assert torch.allclose(rows[0], torch.tensor([255.0, 0.0, 0.0]))
            assert torch.allclose(rows[-1], torch.tensor([0.0, 0.0, 255.0]))
            with pytest.raises(InvalidInput, match=r"mm_items\[0\]: .*limit is 100 pixels"):
                await encoder.load_items([web.url("/huge.png")])
            with pytest.raises(InvalidInput, match=r"mm_items\[1\]: fetching .* got HTTP 404"):
                await encoder.load_items([image_uri(blue), web.url("/nope.png")])
            nursery.cancel_scope.cancel()


def test_a_malformed_private_network_is_a_settings_error() -> None:
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 network"):
        EncoderSettings(remote_private_networks=("10.0.0.0/33",))


async def test_an_https_url_on_a_plain_http_server_says_why_it_failed() -> None:
    """A plain-HTTP server answers a TLS hello with a 400 in clear text and closes; the
    handshake fails with an empty message on top of the ``SSLError`` that says why."""

    async def plain_http(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(4096)  # the TLS ClientHello
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, plain_http, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(InvalidInput) as raised:
            await fetcher(private_networks=LOOPBACK).fetch(f"https://127.0.0.1:{port}/a.png")
        nursery.cancel_scope.cancel()
    assert raised.value.message == (
        f"cannot fetch https://127.0.0.1:{port}/a.png: TLS handshake failed: "
        "WRONG_VERSION_NUMBER (is it a plain-HTTP server?)"
    )
