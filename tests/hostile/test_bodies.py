"""Case 6, the body checks: a huge string in a small field, and many huge bodies at once.

- A 10 MiB ``modality`` (and the same in every other string field a client controls) gets a
  400 (or 413 where the route's body limit applies) whose body is small (< 4 KiB): an error
  quotes at most a clipped part of what it was sent.
- 16 ``/encode`` bodies of 60 MiB each, all at once: the server refuses beyond its total budget
  of bodies in flight (503 ``overloaded``, or 413/400 for a body or image past its own limit)
  and its RSS grows by less than :data:`BIG_RSS_BOUND`. Measured on main before the fix, it
  took them all: RSS +1.0 GiB (+1.3 GiB from 16 addresses), ``/livez`` up to 0.76 s, an honest
  rank's round trip 2.5-8.6 s; and a 10 MiB ``modality`` came back whole in its 400.
"""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from hostile.rig import (
    Exchange,
    Honest,
    MiB,
    Server,
    connect,
    contract_error,
    read_all,
    request_head,
    withstand,
)
from trio_encode.testing.images import image_uri, noise_png

SMALL_ANSWER = 4096
HUGE_STRING = 10 * MiB
RSS_BOUND = 192 * MiB
"""For the 10 MiB strings: each body is held a few times over while it is parsed."""
BIG_BODY = 60 * MiB
BIG_BODIES = 16
BIG_RSS_BOUND = 512 * MiB
"""For 16 x 60 MiB (960 MiB offered): the default ``--max-bodies-in-flight-bytes`` (256 MiB)
twice over, for the copies a body is held in while it is parsed."""
BIG_STATUSES = frozenset({400, 413, 503})


def _huge_string_bodies() -> list[tuple[str, str, dict[str, object]]]:
    huge = "M" * HUGE_STRING
    image = image_uri(noise_png(5))
    encode = {"req_id": "huge-string", "mm_items": [image]}
    return [
        ("modality", "/encode", {**encode, "modality": huge}),
        ("req_id", "/encode", {**encode, "req_id": huge}),
        ("prefill_host", "/encode", {**encode, "prefill_host": huge, "embedding_port": 5}),
        ("mm_items[0]", "/encode", {**encode, "mm_items": [huge]}),
        ("mm_items[0].url", "/encode", {**encode, "mm_items": [{"url": huge}]}),
        ("hashes", "/encode", {**encode, "hashes": huge}),
        ("session_id", "/send", {"req_id": "x", "session_id": huge, "buffer_address": 64}),
    ]


async def huge_strings(server: Server) -> dict[str, int]:
    """Each body once; each answer a contract error, small. Returns each status by field."""
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        for field, route, body in _huge_string_bodies():
            response = await http.post(route, json=body)
            statuses[field] = response.status_code
            assert response.status_code in (400, 413), (field, response.status_code)
            assert len(response.content) < SMALL_ANSWER, (
                f"a 10 MiB {field} got a {len(response.content)}-byte answer: "
                f"{response.content[:300]!r}..."
            )
            assert contract_error(response.status_code, response.json()) is None
    return statuses


async def test_a_10_mib_string_gets_a_small_400(server: Server, honest: Honest) -> None:
    statuses, _ = await withstand(server, honest, lambda: huge_strings(server), rss_bound=RSS_BOUND)
    assert statuses["modality"] == 400


async def big_body(port: int, index: int, *, source: str, chunk_pause: float = 0.0) -> Exchange:
    """One ``/encode`` of :data:`BIG_BODY` bytes (a JSON body whose one item is a data URI of
    that size), streamed in 1 MiB chunks while the answer is read: the server may answer and
    stop reading long before the end."""
    head = f'{{"req_id": "big-{index}-{time.monotonic_ns()}", "mm_items": ["data:image/png;base64,'
    tail = b'"]}'
    filler = b"A" * MiB
    body_size = BIG_BODY
    chunks = (body_size - len(head) - len(tail)) // MiB
    last = body_size - len(head) - len(tail) - chunks * MiB
    result = Exchange()
    stream = await connect(port, source=source)
    try:
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                try:
                    await stream.send_all(request_head("POST", "/encode", content_length=body_size))
                    await stream.send_all(head.encode())
                    for _ in range(chunks):
                        await stream.send_all(filler)
                        if chunk_pause:
                            await trio.sleep(chunk_pause)
                    await stream.send_all(filler[:last] + tail)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the server answered and closed: nothing more to send

            async def receive() -> None:
                await read_all(stream, result, within=60, answers=1)
                nursery.cancel_scope.cancel()

            nursery.start_soon(send)
            nursery.start_soon(receive)
    finally:
        await stream.aclose()
    return result


async def big_bodies(server: Server, *, sources: list[str], chunk_pause: float = 0.0) -> list[int]:
    """:data:`BIG_BODIES` bodies at once, the i-th from ``sources[i % len(sources)]``; each
    must be answered with a contract error of :data:`BIG_STATUSES`. Returns the statuses."""
    results: list[Exchange] = []

    async def one(index: int) -> None:
        source = sources[index % len(sources)]
        results.append(await big_body(server.port, index, source=source, chunk_pause=chunk_pause))

    async with trio.open_nursery() as nursery:
        for index in range(BIG_BODIES):
            nursery.start_soon(one, index)
    statuses = []
    for result in results:
        answers = result.answers
        assert answers, f"a 60 MiB body got no answer (timed out: {result.timed_out})"
        status = answers[0].status
        assert status in BIG_STATUSES, (status, answers[0].body[:300])
        assert contract_error(status, answers[0].json()) is None, answers[0].body[:300]
        statuses.append(status)
    return statuses


async def test_16_bodies_of_60_mib_at_once_from_one_client(server: Server, honest: Honest) -> None:
    statuses, watch = await withstand(
        server,
        honest,
        lambda: big_bodies(server, sources=["127.0.0.2"]),
        rss_bound=BIG_RSS_BOUND,
    )
    assert 503 in statuses, f"no body was refused for the budget: {statuses} ({watch.summary()})"


@pytest.mark.hostile
async def test_16_bodies_of_60_mib_from_16_clients_slowly_twice(
    server: Server, honest: Honest
) -> None:
    """From 16 addresses, so only the total budget bounds them; the honest rank may be told
    503 while they hold it, and retries after ``Retry-After`` as the contract says."""
    sources = [f"127.0.0.{10 + i}" for i in range(BIG_BODIES)]

    async def attack() -> None:
        await big_bodies(server, sources=sources)
        await big_bodies(server, sources=sources, chunk_pause=0.02)

    await withstand(server, honest, attack, rss_bound=BIG_RSS_BOUND, retry_overloaded=30)
