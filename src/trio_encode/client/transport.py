"""A keep-alive HTTP/1.1 transport for httpx on Trio, cheap enough for one call per send.

A prefill rank calls ``/send`` once per request and rank, so what its client spends per call
is paid on every request, on the rank's own CPU. httpx's default transport (httpcore, parsing
with h11) spent about 0.3 ms of CPU per small POST on a 2-core test machine; this one keeps
httpx's interface (its client, models, timeouts and exceptions) and replaces only the wire:
requests are written as bytes, answers parsed by ``httptools`` (llhttp, in C), connections
reused. Measured on that machine with the same server: 0.23 ms -> about 0.1 ms of client CPU
per call (``trio-encode bench`` shows the effect on the /send rows).

Scope, on purpose: plain ``http://`` (an ``https://`` client keeps httpx's own transport), no
HTTP/2, no proxies, no pipelining, answers read whole (the contract's answers are small JSON
documents). A connection is reused only after a complete answer that allows it; one that was
idle longer than ``keepalive_expiry`` or has anything to read (the server closed it) is
dropped before use, so a POST is never written into a connection the server is closing.
Anything that interrupts a call (an error, a timeout, a cancellation) closes its connection:
a half-read answer can never be taken for the next call's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httptools
import httpx
import trio

KEEPALIVE_EXPIRY = 2.0
"""Seconds an idle connection is kept: under the 5 s after which hypercorn and uvicorn close
idle connections, so the client drops one first instead of writing into a closing one."""
MAX_IDLE = 32
"""Idle connections kept per server: a burst of concurrent calls opens one connection each,
and only this many stay open after it (the rest are closed as their answers complete)."""


@dataclass(eq=False)
class _Answer:
    """httptools' callbacks: one HTTP response as it is parsed."""

    bodyless: bool
    """The answer to a HEAD request: complete once its headers are."""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    headers_complete: bool = False
    complete: bool = False
    keep_alive: bool = False
    """Whether the connection may carry another call (llhttp answers this only while its
    callbacks run)."""
    parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_complete = True
        self.keep_alive = bool(self.parser.should_keep_alive())
        self.complete = self.bodyless

    def until_close(self) -> bool:
        """An answer with neither a length nor chunks, whose body ends where the stream does."""
        names = {name.lower() for name, _ in self.headers}
        return self.headers_complete and not names & {b"content-length", b"transfer-encoding"}

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


@dataclass(eq=False)
class _Connection:
    stream: trio.SocketStream
    idle_since: float = 0.0

    def reusable(self, now: float, expiry: float) -> bool:
        """Not idle too long, and nothing to read: a closed or closing peer makes the socket
        readable (EOF), and a server sends nothing unasked between answers."""
        return now - self.idle_since < expiry and not self.stream.socket.is_readable()


def _timeouts(request: httpx.Request) -> dict[str, float | None]:
    timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
    return timeouts


def _deadline(seconds: float | None) -> float:
    return trio.current_time() + seconds if seconds is not None else float("inf")


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=KeepAliveTransport())``: see the module's docstring."""

    def __init__(
        self, *, keepalive_expiry: float = KEEPALIVE_EXPIRY, max_idle: int = MAX_IDLE
    ) -> None:
        self._expiry = keepalive_expiry
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"KeepAliveTransport speaks plain http only, not {request.url.scheme!r}",
                request=request,
            )
        if self._closed:
            raise RuntimeError("the transport is closed")
        key = (request.url.host, request.url.port or 80)
        payload = _serialise(request, await request.aread())
        connection = await self._checkout(key, request)
        try:
            response, keep_alive = await self._exchange(connection, request, payload)
        except BaseException:
            await trio.aclose_forcefully(connection.stream)
            raise
        await self._check_in(key, connection, keep_alive)
        return response

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await trio.aclose_forcefully(connection.stream)

    async def _checkout(self, key: tuple[str, int], request: httpx.Request) -> _Connection:
        now = time.monotonic()
        idle = self._idle.get(key, [])
        while idle:
            connection = idle.pop()
            if connection.reusable(now, self._expiry):
                return connection
            await trio.aclose_forcefully(connection.stream)
        with trio.move_on_at(_deadline(_timeouts(request).get("connect"))):
            try:
                stream = await trio.open_tcp_stream(*key)
            except OSError as exc:
                raise httpx.ConnectError(str(exc), request=request) from exc
            return _Connection(stream)
        raise httpx.ConnectTimeout(f"no connection to {key[0]}:{key[1]} in time", request=request)

    async def _check_in(
        self, key: tuple[str, int], connection: _Connection, keep_alive: bool
    ) -> None:
        """Keep the connection for the next call when its answer allows it and there is room."""
        idle = self._idle.setdefault(key, [])
        if keep_alive and not self._closed and len(idle) < self._max_idle:
            connection.idle_since = time.monotonic()
            idle.append(connection)
        else:
            await trio.aclose_forcefully(connection.stream)

    async def _exchange(
        self, connection: _Connection, request: httpx.Request, payload: bytes
    ) -> tuple[httpx.Response, bool]:
        """Write the request and read its whole answer; the answer and whether the
        connection may carry another call."""
        timeouts = _timeouts(request)
        with trio.move_on_at(_deadline(timeouts.get("write"))) as writing:
            try:
                await connection.stream.send_all(payload)
            except (OSError, trio.BrokenResourceError) as exc:
                raise httpx.WriteError(str(exc), request=request) from exc
        if writing.cancelled_caught:
            raise httpx.WriteTimeout("the request was not written in time", request=request)
        answer = _Answer(bodyless=request.method == "HEAD")
        parser = answer.parser = httptools.HttpResponseParser(answer)
        read_timeout = timeouts.get("read")
        while not answer.complete:
            with trio.move_on_after(read_timeout if read_timeout is not None else float("inf")):
                try:
                    data = await connection.stream.receive_some()
                except (OSError, trio.BrokenResourceError) as exc:
                    raise httpx.ReadError(str(exc), request=request) from exc
                if not data and answer.until_close():
                    answer.complete = True
                    break
                if not data:
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection before a complete answer",
                        request=request,
                    )
                try:
                    parser.feed_data(data)
                except httptools.HttpParserError as exc:
                    raise httpx.RemoteProtocolError(
                        f"malformed answer: {exc}", request=request
                    ) from exc
                continue
            raise httpx.ReadTimeout("no complete answer in time", request=request)
        response = httpx.Response(
            parser.get_status_code(),
            headers=answer.headers,
            content=b"".join(answer.body),
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )
        return response, answer.keep_alive


def _serialise(request: httpx.Request, body: bytes) -> bytes:
    """The request's bytes on the wire; httpx has already set Host and Content-Length."""
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.url.raw_path)]
    lines += [b"%s: %s\r\n" % (name, value) for name, value in request.headers.raw]
    lines.append(b"\r\n")
    lines.append(body)
    return b"".join(lines)
