"""Case 5, and the first check of case 6: completion messages (SGLang's ZMQ pushes) aimed
where nobody listens, or at many places at once, or for requests that do not exist.

- A failing ``/encode`` naming 300 closed ports as its ranks' endpoints (``prefill_host``,
  ``embedding_port``): the server tries each for ``--completion-timeout`` (5 s). A real rank's
  ``/send`` naming its live PULL socket meanwhile must still get 200 and its done message.
  Measured on main before the fix: the 300 dead pushes held every one of the pusher's 256
  sockets, and the live rank's ``/send`` got 502 ``completion_failed``.
- A failing ``/encode`` naming 4,000 ports: refused or capped, ``/livez`` fast, and not a log
  line per port.
- A ``/send`` for a ``req_id`` the server never held pushes nothing to the endpoint it names.
"""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from hostile.rig import Honest, MiB, Pull, Server, closed_ports, contract_error, withstand
from trio_encode.testing.images import image_uri

BROKEN = image_uri(b"not an image either")
COMPLETION_TIMEOUT = 5.0
"""The server's ``--completion-timeout`` (its default)."""
RSS_BOUND = 64 * MiB
LOG_LINES_BOUND = 50
"""Log lines (access log aside) one failing request naming thousands of endpoints may cost."""


async def failing_encode(server: Server, ports: list[int], label: str) -> httpx.Response:
    body = {
        "req_id": f"{label}-{time.monotonic_ns()}",
        "mm_items": [BROKEN],
        "prefill_host": "127.0.0.1",
        "embedding_port": ports,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        response = await http.post("/encode", json=body)
    assert response.status_code == 400, response.text[:300]
    assert contract_error(400, response.json()) is None, response.text[:300]
    return response


async def dead_endpoints_then_a_live_rank(
    server: Server, honest: Honest, closed: int, ranks: int
) -> None:
    """A failing ``/encode`` naming ``closed`` dead endpoints, then ``ranks`` live ranks one
    after another, each while those pushes still wait (within the completion timeout)."""
    started = time.monotonic()
    await failing_encode(server, closed_ports(closed), "closed-ports")
    for _ in range(ranks):
        with Pull() as pull:
            await honest.round_trip(notify=pull)
    assert time.monotonic() - started < COMPLETION_TIMEOUT, "the pushes were no longer pending"


async def test_300_dead_endpoints_leave_a_live_rank_its_done_message(
    server: Server, honest: Honest
) -> None:
    await withstand(
        server,
        honest,
        lambda: dead_endpoints_then_a_live_rank(server, honest, 300, 1),
        rss_bound=RSS_BOUND,
    )


@pytest.mark.hostile
async def test_2000_dead_endpoints_from_seven_requests_and_live_ranks_beside(
    server: Server, honest: Honest
) -> None:
    async def attack() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(7):
                nursery.start_soon(failing_encode, server, closed_ports(300), "dead-wave")
        await dead_endpoints_then_a_live_rank(server, honest, 300, 5)

    await withstand(server, honest, attack, rss_bound=RSS_BOUND)


def _many_closed_ports(count: int) -> list[int]:
    ports: dict[int, None] = {}
    while len(ports) < count:
        ports.update(dict.fromkeys(closed_ports(min(1000, count - len(ports)))))
    return list(ports)[:count]


async def thousands_of_endpoints(server: Server, count: int) -> list[str]:
    """A failing ``/encode`` naming ``count`` endpoints; the log lines the server wrote in the
    completion timeout that followed (the access log's and the honest rank's aside)."""
    mark = server.mark()
    await failing_encode(server, _many_closed_ports(count), "many-ports")
    await trio.sleep(COMPLETION_TIMEOUT + 1)
    return [line for line in server.logged_since(mark) if "req_id=honest-" not in line]


async def test_4000_endpoints_are_refused_or_capped(server: Server, honest: Honest) -> None:
    lines, _ = await withstand(
        server, honest, lambda: thousands_of_endpoints(server, 4000), rss_bound=RSS_BOUND
    )
    assert len(lines) < LOG_LINES_BOUND, (
        f"{len(lines)} log lines for one request; the first: {lines[:3]}"
    )


async def test_a_send_for_a_request_never_held_pushes_nothing(server: Server) -> None:
    with Pull() as pull:
        body = {
            "req_id": f"never-held-{time.monotonic_ns()}",
            "session_id": "127.0.0.1:5",
            "buffer_address": 4096,
            "prefill_host": "127.0.0.1",
            "embedding_port": pull.port,
            "part_idx": 0,
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            response = await http.post("/send", json=body)
        assert response.status_code == 404, response.text[:300]
        assert contract_error(404, response.json()) is None
        await pull.nothing_arrives(within=1.0)
    server.assert_alive()
