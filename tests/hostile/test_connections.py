"""Case 7: connection-level abuse, all at once: half-closes and resets at every point of a
request, pipelined requests, clients that never read their (large) answers, garbage where a
request line belongs, headers far too large. Nothing may end the process or stall its event
loop; every connection that waits for an answer gets one (or is closed) within
:data:`ANSWER_WITHIN`, never a 5xx; pipelined requests are answered in order.
"""

from __future__ import annotations

import socket
from functools import partial

import pytest
import trio

from hostile.rig import (
    Exchange,
    Honest,
    MiB,
    Server,
    connect,
    exchange,
    request_head,
    reset,
    withstand,
)
from trio_encode.server.serve import KEEP_ALIVE_SECONDS

ANSWER_WITHIN = 10.0
RSS_BOUND = 64 * MiB
JSON = b'{"req_id": "abuse", "mm_items": ["data:image/png;base64,iVBORw0KGgo"]}'

PIPELINED = [
    (request_head("GET", "/livez"), 200),
    (request_head("GET", "/readyz"), 200),
    (request_head("GET", "/metrics"), 200),
    (request_head("POST", "/send", content_length=2) + b"{}", 400),
    (request_head("GET", "/no-such-route"), 404),
    (request_head("POST", "/livez", content_length=2) + b"{}", 405),
    (request_head("GET", "/health"), 200),
    (request_head("GET", "/livez", headers=[("Connection", "close")]), 200),
]
"""Well-formed requests sent in one write, and the status each must get, in this order."""

GARBAGE = [
    b"\x00\xff\xfe\x01 not http at all\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\r\n" * 5000,
    bytes.fromhex("16030100a5010000a10303") + b"\x00" * 160,  # a TLS ClientHello's start
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64,
    b"POST /encode HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
    + b"0\r\n\r\n",
    b"POST /encode HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    b"POST /encode HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"ffffffffffffffff\r\nabc",
    b"POST /send HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /send HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    b"GET /livez HTTP/1.1\r\n" + b"X: y\r\n" * 3 + b"\r\n",  # no Host
]
"""What arrives where a request belongs (each then half-closed)."""

HUGE_HEADERS = [
    request_head("GET", "/livez", headers=[("X-Big", "v" * MiB)]),
    request_head("GET", "/livez", headers=[(f"X-{i}", "v") for i in range(10_000)]),
    request_head("POST", "/encode", headers=[("Cookie", "c=" + "x" * 200_000)]),
]


def _cut_points(request: bytes) -> list[bytes]:
    """The request cut inside its request line, inside its headers, and inside its body."""
    head_end = request.index(b"\r\n\r\n")
    return [request[:5], request[: head_end // 2], request[: head_end + 4 + len(JSON) // 2]]


async def _slow_reader(port: int, holding: trio.Event) -> None:
    """Pipelines 200 ``GET /metrics`` and reads nothing until ``holding`` is set; then resets."""
    stream = await connect(port)
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        with trio.move_on_after(30):
            await stream.send_all(request_head("GET", "/metrics") * 200)
        await holding.wait()
    finally:
        await reset(stream)


async def abuse(port: int, rounds: int, slow_readers: int) -> list[Exchange]:
    """``rounds`` of every kind of abuse at once, beside ``slow_readers`` connections that
    never read. Returns what each connection that waited for answers got."""
    request = request_head("POST", "/encode", content_length=len(JSON)) + JSON
    waited: list[Exchange] = []
    pipelined: list[Exchange] = []

    async def wait_for(*parts: bytes) -> None:
        waited.append(await exchange(port, *parts, end="half-close", read_for=ANSWER_WITHIN))

    async def pipeline() -> None:
        raw = b"".join(part for part, _ in PIPELINED)
        pipelined.append(
            await exchange(port, raw, end="keep", read_for=ANSWER_WITHIN, answers=len(PIPELINED))
        )

    done_holding = trio.Event()
    async with trio.open_nursery() as holders:
        for _ in range(slow_readers):
            holders.start_soon(_slow_reader, port, done_holding)
        for _ in range(rounds):
            async with trio.open_nursery() as nursery:
                for cut in _cut_points(request):
                    nursery.start_soon(wait_for, cut)
                    nursery.start_soon(partial(exchange, port, cut, end="reset"))
                    nursery.start_soon(partial(exchange, port, cut, end="close"))
                for garbage in GARBAGE:
                    nursery.start_soon(wait_for, garbage)
                for headers in HUGE_HEADERS:
                    nursery.start_soon(wait_for, headers)
                    nursery.start_soon(partial(exchange, port, headers, end="reset"))
                for _ in range(4):
                    nursery.start_soon(pipeline)
        done_holding.set()

    for result in pipelined:
        statuses = [answer.status for answer in result.answers]
        assert statuses == [status for _, status in PIPELINED], statuses
    return waited


def check(results: list[Exchange]) -> None:
    for result in results:
        assert not result.refused, "a connection was refused"
        assert not result.timed_out, f"neither answered nor closed within {ANSWER_WITHIN} s"
        for answer in result.answers:
            assert answer.status < 500, (answer.status, answer.body[:200])


async def test_a_round_of_every_connection_abuse(server: Server, honest: Honest) -> None:
    results, _ = await withstand(
        server, honest, lambda: abuse(server.port, 2, 4), rss_bound=RSS_BOUND
    )
    check(results)


@pytest.mark.hostile
async def test_thirty_rounds_of_every_connection_abuse(server: Server, honest: Honest) -> None:
    results, _ = await withstand(
        server, honest, lambda: abuse(server.port, 30, 50), rss_bound=RSS_BOUND
    )
    check(results)


IDLE_CLOSED_WITHIN = KEEP_ALIVE_SECONDS + 10.0
"""Seconds an answered keep-alive connection may sit idle before the server closes it
(hypercorn's ``keep_alive_timeout`` is 5 s by default)."""


async def idle_after_one_answer(port: int, connections: int) -> list[Exchange]:
    """``connections`` clients that each get one answer and then neither send nor close."""
    results: list[Exchange] = []

    async def one(index: int) -> None:
        close = [("Connection", "close")] if index % 2 else []
        results.append(
            await exchange(
                port,
                request_head("GET", "/livez", headers=close),
                end="keep",
                read_for=IDLE_CLOSED_WITHIN,
            )
        )

    async with trio.open_nursery() as nursery:
        for index in range(connections):
            nursery.start_soon(one, index)
    return results


@pytest.mark.hostile
async def test_answered_connections_left_idle_are_closed(server: Server, honest: Honest) -> None:
    """A client that holds connections open after its answers (half of them asked for
    ``Connection: close``) must not keep them: each is closed within
    :data:`IDLE_CLOSED_WITHIN` seconds, or a few thousand such clients hold every descriptor."""
    results, _ = await withstand(
        server, honest, lambda: idle_after_one_answer(server.port, 200), rss_bound=RSS_BOUND
    )
    held = sum(result.timed_out for result in results)
    assert held == 0, (
        f"{held} of {len(results)} idle connections still open after {IDLE_CLOSED_WITHIN} s"
    )
    assert all(len(result.answers) == 1 for result in results)
