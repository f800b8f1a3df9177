"""Case 1: bodies cut short of their ``Content-Length``, then a half-close.

Each connection sends a request whose body stops before its declared length and shuts its
sending side (``shutdown(SHUT_WR)``), to ``/encode``, ``/send``, ``/livez`` and a route that
does not exist. The server must answer (or close) each one, and nothing else: measured on
main before the fix, hypercorn's Trio worker raised ``trio.BusyResourceError`` (its error
answer and its own send raced on one stream) in a connection task and the process exited
within a second.
"""

from __future__ import annotations

import pytest
import trio

from hostile.rig import Exchange, Honest, MiB, Server, exchange, request_head, withstand

ROUTES = ("/encode", "/send", "/livez", "/no-such-route")
BODY = b'{"req_id": "cut-short", "mm_items": ["data:image/png;base64,iVBORw0KGgo'
RSS_BOUND = 64 * MiB


def cut_short(route: str, method: str = "POST", *, declared: int = 1000, sent: int = 14) -> bytes:
    """A request declaring ``declared`` body bytes that carries only the first ``sent``."""
    return request_head(method, route, content_length=declared) + BODY[:sent]


async def attack(port: int, connections: int, *, waves: int = 1) -> list[Exchange]:
    """``connections`` cut-short requests at once (over every route), ``waves`` times; the
    cut falls at a different point of the body in each wave."""
    results: list[Exchange] = []

    async def one(index: int, wave: int) -> None:
        route = ROUTES[index % len(ROUTES)]
        method = "GET" if wave % 2 and route == "/livez" else "POST"
        request = cut_short(route, method, sent=(index + wave * 7) % len(BODY))
        results.append(await exchange(port, request, end="half-close", read_for=10))

    for wave in range(waves):
        async with trio.open_nursery() as nursery:
            for index in range(connections):
                nursery.start_soon(one, index, wave)
    return results


def check(results: list[Exchange]) -> None:
    for result in results:
        assert not result.refused, "a connection was refused"
        assert not result.timed_out, "a cut-short request was neither answered nor closed"
        for answer in result.answers:
            assert answer.status < 500, (answer.status, answer.body[:200])


async def test_200_cut_short_bodies_then_half_closes(server: Server, honest: Honest) -> None:
    results, _ = await withstand(
        server, honest, lambda: attack(server.port, 200), rss_bound=RSS_BOUND
    )
    check(results)


@pytest.mark.hostile
async def test_1000_cut_short_bodies_in_five_waves(server: Server, honest: Honest) -> None:
    results, _ = await withstand(
        server, honest, lambda: attack(server.port, 200, waves=5), rss_bound=RSS_BOUND
    )
    check(results)
