"""KeepAliveTransport against a scripted HTTP server on loopback: what goes on the wire, which
connections are reused, and how every failure ends its connection.

The server is written here (``trio.serve_tcp`` on port 0): it reads whole requests and writes
the raw bytes a test scripts, so each test controls the wire exactly and counts the
connections the transport opened.
"""

from __future__ import annotations

import gc
import socket
import struct
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import httpx
import pytest
import trio
import trio.testing

from trio_encode.client import EncodeClient
from trio_encode.client import http as client_http
from trio_encode.client.transport import KeepAliveTransport

SOON = 1.0
"""Seconds within which something that should happen at once on loopback has happened."""


@dataclass(frozen=True)
class Seen:
    """One request as the server read it off the wire."""

    index: int
    """Across all of the server's connections, from 0."""
    connection: int
    head: bytes
    """The request line and headers, without the blank line."""
    body: bytes

    @property
    def request_line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    def header(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


@dataclass(frozen=True)
class Answer:
    """What the server does for one request: write ``pieces`` (``pause`` seconds apart), then
    keep the connection and read the next request, close it, or reset it."""

    pieces: tuple[bytes, ...] = ()
    then: Literal["keep", "close", "reset"] = "keep"
    pause: float = 0.0


@dataclass(eq=False)
class ServerConnection:
    index: int
    ended: trio.Event = field(default_factory=trio.Event)
    """The client closed (or reset) its end while the server was reading."""
    closed: trio.Event = field(default_factory=trio.Event)
    """The server closed it, as its script said."""


Script = Callable[[Seen], Answer]


def http_answer(
    body: bytes,
    *headers: bytes,
    status: bytes = b"200 OK",
    version: bytes = b"HTTP/1.1",
) -> bytes:
    """A complete answer with a Content-Length."""
    lines = [version + b" " + status, b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def answering(body: bytes, *headers: bytes) -> Answer:
    return Answer((http_answer(body, *headers),))


class ScriptedServer:
    """Serves each request with ``script(seen)``; records requests and connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.port = 0
        self.connections: list[ServerConnection] = []
        self.seen: list[Seen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, stream: trio.SocketStream) -> None:
        connection = ServerConnection(len(self.connections))
        self.connections.append(connection)
        buffer = bytearray()
        try:
            while True:
                request = await _read_request(stream, buffer)
                if request is None:
                    connection.ended.set()
                    return
                seen = Seen(len(self.seen), connection.index, *request)
                self.seen.append(seen)
                answer = self.script(seen)
                for number, piece in enumerate(answer.pieces):
                    if number:
                        await trio.sleep(answer.pause)
                    await stream.send_all(piece)
                if answer.then != "keep":
                    if answer.then == "reset":
                        linger = struct.pack("ii", 1, 0)
                        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    await stream.aclose()
                    connection.closed.set()
                    return
        except trio.BrokenResourceError:
            connection.ended.set()
        finally:
            await trio.aclose_forcefully(stream)


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> tuple[bytes, bytes] | None:
    """The next request's head and body, or ``None`` at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some()
        if not data:
            return None
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        data = await stream.receive_some()
        if not data:
            return None
        rest += data
    buffer[:] = rest[length:]
    return head, rest[:length]


@asynccontextmanager
async def serving(script: Script) -> AsyncIterator[ScriptedServer]:
    """A scripted server on 127.0.0.1, stopped when the block ends; the block has 5 s."""
    server = ScriptedServer(script)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        server.port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(5):
            yield server
        nursery.cancel_scope.cancel()


async def ended(connection: ServerConnection) -> None:
    """Waits (briefly) for the client to close its end of ``connection``."""
    with trio.fail_after(SOON):
        await connection.ended.wait()


def keep_alive_client(**kwargs: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=KeepAliveTransport(**kwargs), timeout=SOON)


@pytest.fixture(autouse=True)
def _no_socket_closed_by_the_garbage_collector() -> Iterator[None]:
    """Fails a test after which a socket was closed by the garbage collector (its
    ResourceWarning) rather than by whoever held it. CPython closes an unreferenced socket at
    once, so a connection the transport dropped without closing would otherwise look closed
    to the server all the same."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaked


# -- reuse -------------------------------------------------------------------------------------


async def test_sequential_requests_share_one_connection_and_arrive_whole() -> None:
    """Five requests in a row travel on one server connection; every answer's status, headers
    and body come back as written, and every request's bytes carry its method, path, Host,
    Content-Length and body."""

    def script(seen: Seen) -> Answer:
        body = b"answer %d to %s" % (seen.index, seen.body)
        return Answer((http_answer(body, b"X-Seq: %d" % seen.index, status=b"201 Created"),))

    bodies = [(b"payload-%d;" % number) * (number + 1) for number in range(5)]
    async with serving(script) as server, keep_alive_client() as client:
        for number, body in enumerate(bodies):
            response = await client.post(
                f"{server.url}/items/{number}?q=a%20b", content=body, headers={"X-Mine": "yes"}
            )
            assert response.status_code == 201
            assert response.headers["x-seq"] == str(number)
            assert response.content == b"answer %d to %s" % (number, body)
        assert len(server.connections) == 1
        assert [seen.connection for seen in server.seen] == [0] * 5
        for number, (seen, body) in enumerate(zip(server.seen, bodies, strict=True)):
            assert seen.request_line == b"POST /items/%d?q=a%%20b HTTP/1.1" % number
            assert seen.header(b"host") == b"127.0.0.1:%d" % server.port
            assert seen.header(b"content-length") == b"%d" % len(body)
            assert seen.header(b"x-mine") == b"yes"
            assert seen.body == body


@pytest.mark.parametrize(
    "last_word",
    [
        pytest.param(http_answer(b"bye", b"Connection: close"), id="connection-close"),
        pytest.param(http_answer(b"bye", version=b"HTTP/1.0"), id="http-1.0"),
    ],
)
async def test_an_answer_that_ends_keep_alive_makes_the_next_request_dial_anew(
    last_word: bytes,
) -> None:
    """After ``Connection: close`` (or an HTTP/1.0 answer without keep-alive) the transport
    closes that connection itself, even if the server keeps it open, and the next request
    opens a new one."""

    def script(seen: Seen) -> Answer:
        return Answer((last_word,)) if seen.index == 0 else answering(b"fresh")

    async with serving(script) as server, keep_alive_client() as client:
        assert (await client.get(f"{server.url}/one")).content == b"bye"
        await ended(server.connections[0])
        assert (await client.get(f"{server.url}/two")).content == b"fresh"
        assert [seen.connection for seen in server.seen] == [0, 1]


async def test_a_connection_the_server_closed_while_idle_is_not_written_into() -> None:
    """The server answers with keep-alive, then closes the idle connection: the next request
    sees the socket readable, dials anew and succeeds (without the check it would be written
    into the closed connection and fail)."""

    def script(seen: Seen) -> Answer:
        if seen.index == 0:
            return Answer((http_answer(b"one"),), then="close")
        return answering(b"two")

    async with serving(script) as server, keep_alive_client() as client:
        assert (await client.post(f"{server.url}/a", content=b"x")).content == b"one"
        with trio.fail_after(SOON):
            await server.connections[0].closed.wait()
        await trio.sleep(0.02)  # the FIN crosses loopback
        assert (await client.post(f"{server.url}/b", content=b"y")).content == b"two"
        assert [seen.connection for seen in server.seen] == [0, 1]


async def test_a_connection_idle_past_keepalive_expiry_is_dropped() -> None:
    """With ``keepalive_expiry=0.05``, a request 0.1 s after the last one closes the old
    connection (which the server kept open) and uses a new one."""
    async with (
        serving(lambda seen: answering(b"%d" % seen.index)) as server,
        keep_alive_client(keepalive_expiry=0.05) as client,
    ):
        assert (await client.get(f"{server.url}/")).content == b"0"
        await trio.sleep(0.1)
        assert (await client.get(f"{server.url}/")).content == b"1"
        await ended(server.connections[0])
        assert [seen.connection for seen in server.seen] == [0, 1]


async def test_no_more_than_max_idle_connections_stay_open_after_a_burst() -> None:
    """Three concurrent calls open three connections; with ``max_idle=1`` two are closed as
    their answers complete, and the next call reuses the one kept."""
    release = trio.Event()

    async with (
        serving(lambda seen: answering(b"%d" % seen.index)) as server,
        keep_alive_client(max_idle=1) as client,
    ):

        async def call() -> None:
            await release.wait()
            assert (await client.get(f"{server.url}/")).status_code == 200

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert len(server.connections) == 3
        for connection in server.connections:
            with trio.move_on_after(SOON):
                await connection.ended.wait()
        assert sum(connection.ended.is_set() for connection in server.connections) == 2
        (kept,) = [c.index for c in server.connections if not c.ended.is_set()]
        await client.get(f"{server.url}/")
        assert server.seen[-1].connection == kept
        assert len(server.connections) == 3


# -- answer framing ----------------------------------------------------------------------------


async def test_a_chunked_answer_is_read_whole_and_its_connection_reused() -> None:
    """A chunked answer split across several writes comes back whole, and the connection
    carries the next request."""
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"lo\r\n6\r\n world\r\n",
        b"0\r\n\r\n",
    )

    def script(seen: Seen) -> Answer:
        return Answer(chunked, pause=0.01) if seen.index == 0 else answering(b"next")

    async with serving(script) as server, keep_alive_client() as client:
        response = await client.get(f"{server.url}/chunks")
        assert response.status_code == 200
        assert response.content == b"hello world"
        assert (await client.get(f"{server.url}/next")).content == b"next"
        assert len(server.connections) == 1


async def test_an_answer_without_length_or_chunks_ends_at_eof_and_is_not_reused() -> None:
    """An answer with neither Content-Length nor chunks is read until the server closes; the
    next request opens a new connection."""
    until_close = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ", b"the end")

    def script(seen: Seen) -> Answer:
        if seen.index == 0:
            return Answer(until_close, then="close", pause=0.01)
        return answering(b"again")

    async with serving(script) as server, keep_alive_client() as client:
        response = await client.get(f"{server.url}/stream")
        assert (response.status_code, response.content) == (200, b"until the end")
        assert (await client.get(f"{server.url}/again")).content == b"again"
        assert [seen.connection for seen in server.seen] == [0, 1]


async def test_a_head_answer_completes_with_its_headers() -> None:
    """A HEAD answer's Content-Length announces no body to wait for: the call completes at the
    blank line, and the connection carries the next request on the same connection."""

    def script(seen: Seen) -> Answer:
        if seen.request_line.startswith(b"HEAD "):
            return Answer((b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n",))
        return answering(b"body")

    async with serving(script) as server, keep_alive_client() as client:
        head = await client.head(f"{server.url}/thing")
        assert (head.status_code, head.headers["content-length"], head.content) == (200, "42", b"")
        assert (await client.get(f"{server.url}/thing")).content == b"body"
        assert len(server.connections) == 1


async def test_a_no_content_answer_keeps_its_connection() -> None:
    """A 204 has no body by definition, length or not: the connection carries the next
    request (it is not mistaken for an answer that ends where the stream does)."""

    def script(seen: Seen) -> Answer:
        if seen.index == 0:
            return Answer((b"HTTP/1.1 204 No Content\r\n\r\n",))
        return answering(b"after")

    async with serving(script) as server, keep_alive_client() as client:
        empty = await client.post(f"{server.url}/nothing", content=b"x")
        assert (empty.status_code, empty.content) == (204, b"")
        assert (await client.get(f"{server.url}/after")).content == b"after"
        assert len(server.connections) == 1


# -- interrupted calls -------------------------------------------------------------------------


async def test_a_read_timeout_closes_the_connection() -> None:
    """A server that never answers gives ``httpx.ReadTimeout``; the connection is closed (the
    server reads EOF) and the next request works on a new one."""

    def script(seen: Seen) -> Answer:
        return Answer() if seen.index == 0 else answering(b"late but fine")

    async with serving(script) as server, keep_alive_client() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(f"{server.url}/silent", timeout=0.2)
        await ended(server.connections[0])
        assert (await client.get(f"{server.url}/loud")).content == b"late but fine"
        assert [seen.connection for seen in server.seen] == [0, 1]


async def test_a_cancelled_call_closes_its_connection() -> None:
    """A cancel scope around a call whose answer stopped half-way: the transport closes that
    connection (the server reads EOF; the module's fixture fails the test if the garbage
    collector had to), and the next call gets its own answer on a new connection, not the
    leftover of the first."""
    half = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"

    def script(seen: Seen) -> Answer:
        if seen.index == 0:
            return Answer((half,))  # then waits, reading
        return answering(b"the second")

    async with serving(script) as server, keep_alive_client() as client:
        with trio.move_on_after(0.2) as scope:
            await client.get(f"{server.url}/first")
        assert scope.cancelled_caught
        await ended(server.connections[0])
        response = await client.get(f"{server.url}/second")
        assert (response.status_code, response.content) == (200, b"the second")
        assert [seen.connection for seen in server.seen] == [0, 1]


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param((), id="nothing"),
        pytest.param((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf",), id="half-body"),
        pytest.param((b"HTTP/1.1 200 OK\r\nContent-Le",), id="half-head"),
    ],
)
async def test_a_server_that_closes_mid_answer_is_a_protocol_error(sent: tuple[bytes, ...]) -> None:
    """EOF before the answer is complete raises ``httpx.RemoteProtocolError``; the next call
    works on a new connection."""

    def script(seen: Seen) -> Answer:
        return Answer(sent, then="close") if seen.index == 0 else answering(b"ok")

    async with serving(script) as server, keep_alive_client() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"{server.url}/cut")
        assert (await client.get(f"{server.url}/whole")).content == b"ok"
        assert [seen.connection for seen in server.seen] == [0, 1]


async def test_a_reset_connection_is_a_read_error() -> None:
    """A server that resets the connection instead of answering gives ``httpx.ReadError``."""
    async with serving(lambda seen: Answer(then="reset")) as server, keep_alive_client() as client:
        with pytest.raises(httpx.ReadError):
            await client.get(f"{server.url}/reset")


async def test_a_malformed_status_line_is_a_protocol_error_and_closes_the_connection() -> None:
    """Bytes that are not an HTTP answer raise ``httpx.RemoteProtocolError``, and the
    transport closes that connection although the server keeps it open."""

    def script(seen: Seen) -> Answer:
        return Answer((b"HTTX/1.1 2OO Fine\r\n\r\n",)) if seen.index == 0 else answering(b"ok")

    async with serving(script) as server, keep_alive_client() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"{server.url}/garbled")
        await ended(server.connections[0])
        assert (await client.get(f"{server.url}/fine")).content == b"ok"


async def test_nothing_listening_is_a_connect_error() -> None:
    """A port nobody listens on gives ``httpx.ConnectError``."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    async with keep_alive_client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/")


# -- scope and closing -------------------------------------------------------------------------


async def test_https_is_unsupported() -> None:
    """The transport speaks plain http only: an ``https://`` URL raises
    ``httpx.UnsupportedProtocol`` before anything is dialled."""
    async with keep_alive_client() as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("https://127.0.0.1:1/")


async def test_aclose_closes_idle_connections() -> None:
    """Closing the client closes the transport's idle connections (the server reads EOF), and
    the closed transport takes no more calls."""
    transport = KeepAliveTransport()
    async with serving(lambda seen: answering(b"hi")) as server:
        client = httpx.AsyncClient(transport=transport, timeout=SOON)
        assert (await client.get(f"{server.url}/")).content == b"hi"
        assert not server.connections[0].ended.is_set()
        await client.aclose()
        await ended(server.connections[0])
        with pytest.raises(RuntimeError, match="closed"):
            await transport.handle_async_request(httpx.Request("GET", f"{server.url}/"))
        assert len(server.seen) == 1


# -- EncodeClient ------------------------------------------------------------------------------


async def test_encode_client_over_http_uses_the_keep_alive_transport() -> None:
    """``EncodeClient("http://...")`` answers through KeepAliveTransport, told apart by
    behaviour: it keeps an HTTP/1.0 connection that says ``Connection: keep-alive`` (llhttp
    honours it), which httpx's own transport (h11) never reuses, as the control shows."""
    keep_alive_1_0 = http_answer(b"{}", b"Connection: keep-alive", version=b"HTTP/1.0")
    async with serving(lambda seen: Answer((keep_alive_1_0,))) as server:
        async with EncodeClient(server.url) as client:
            assert await client.health()
            assert await client.health()
        assert len(server.connections) == 1
        httpx_default = httpx.AsyncClient(base_url=server.url, trust_env=False)
        async with EncodeClient(server.url, http=httpx_default) as control:
            assert await control.health()
            assert await control.health()
        assert len(server.connections) == 3
        assert all(seen.request_line == b"GET /health HTTP/1.1" for seen in server.seen)


async def test_encode_client_over_https_keeps_the_httpx_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``EncodeClient("https://...")`` constructs no KeepAliveTransport (its client keeps
    httpx's own); ``http://`` constructs one."""
    made: list[KeepAliveTransport] = []

    def counting(**kwargs: float) -> KeepAliveTransport:
        made.append(KeepAliveTransport(**kwargs))
        return made[-1]

    monkeypatch.setattr(client_http, "KeepAliveTransport", counting)
    async with EncodeClient("https://127.0.0.1:1") as secure:
        assert not made
        assert not isinstance(secure._http._transport, KeepAliveTransport)
        assert isinstance(secure._http._transport, httpx.AsyncHTTPTransport)
    async with EncodeClient("http://127.0.0.1:1") as plain:
        assert len(made) == 1
        assert plain._http._transport is made[0]
