"""The keep-alive timer of :mod:`trio_encode.server.connections`: one task per connection whose
deadline calls move. An idle connection closes after ``keep_alive_timeout``; a call that takes
longer than that is never cut; a shutdown closes idle connections at once.

Against the real accept loop and hypercorn's per-connection server, with a one-line ASGI app
and raw sockets, so only the connection layer is measured."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config, Sockets

from trio_encode.server.connections import serve_connections

KEEP_ALIVE = 0.5
SLOW = 3 * KEEP_ALIVE
"""What ``/slow`` takes: longer than the idle timeout, which must not cut it."""
REQUEST = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
QUICK = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/slow":
        await trio.sleep(SLOW)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[int, trio.Event]]:
    config = Config()
    config.keep_alive_timeout = KEEP_ALIVE
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_connections(
                ASGIWrapper(app),
                config,
                Sockets([], [listener], []),
                shutdown_trigger=stop.wait,
                connection_failed=lambda kind: 1,
                task_status=task_status,
            )
        )
        yield port, stop
        stop.set()


def answer(sock: socket.socket) -> bytes:
    """One whole answer (its body is ``ok``), or what came before the server closed."""
    data = b""
    while not data.endswith(b"ok"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def answered_then_closed(port: int, requests: list[bytes]) -> tuple[list[bytes], float]:
    """Each request's answer on one connection, then seconds until the server closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        answers = []
        for request in requests:
            sock.sendall(request)
            answers.append(answer(sock))
        answered = time.monotonic()
        assert sock.recv(65536) == b"", "the server closed the connection"
        return answers, time.monotonic() - answered


async def test_an_idle_connection_closes_after_the_timeout_and_a_long_call_is_never_cut() -> None:
    async with serving() as (port, _):
        answers, idle = await trio.to_thread.run_sync(
            answered_then_closed, port, [QUICK, REQUEST, QUICK]
        )
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers), answers
    assert KEEP_ALIVE * 0.8 <= idle < KEEP_ALIVE + 2.0, idle


async def test_a_shutdown_closes_idle_connections_at_once() -> None:
    async with serving() as (port, stop):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(QUICK)
            assert (await trio.to_thread.run_sync(answer, sock)).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            stop.set()
            assert await trio.to_thread.run_sync(sock.recv, 65536) == b""
            assert time.monotonic() - started < KEEP_ALIVE * 0.8


async def test_a_client_that_half_closes_gets_its_answer_and_the_close_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its reading over, the connection closes once answered, not when the timer would."""
    monkeypatch.setattr(sys.modules[__name__], "KEEP_ALIVE", 30.0)

    def half_closed(port: int) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(REQUEST)  # answered after the server has read the client's end
            sock.shutdown(socket.SHUT_WR)
            started = time.monotonic()
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data, time.monotonic() - started

    async with serving() as (port, _):
        data, closed_after = await trio.to_thread.run_sync(half_closed, port)
    assert data.startswith(b"HTTP/1.1 200"), data
    assert closed_after < SLOW + 3.0, closed_after
