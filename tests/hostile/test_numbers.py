"""Cases 2 and 3: integers no prefill rank would send.

Case 2: every integer field of ``/encode``, ``/send`` and ``/scheduler_receive_meta_data`` set
to ``2**2100`` (and its negative) must get a 400 in the contract's shape, at once. Measured on
main before the fix: ``num_parts`` or ``part_idx`` that large reached the completion message
(which packs them in 64 bits) and the process exited; a failing ``/encode`` whose ``num_parts``
was that large looped over its sibling parts forever, and the event loop never answered again.

Case 3: a failing ``/encode`` (an undecodable image, an SGLang part id) naming 3,000,000 parts
is refused by the bound on ``num_parts`` (400), and one naming the most parts the bound allows
is answered 400 (the image) while ``/livez`` stays fast; in the long variant a hundred of them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx
import pytest

from hostile.rig import Honest, MiB, Pull, Server, contract_error, withstand
from trio_encode.server import schemas
from trio_encode.testing.images import image_uri

HUGE = 2**2100
MAX_PARTS: int = getattr(schemas, "MAX_PARTS", 1024)
"""The bound on ``num_parts`` (``trio_encode.server.schemas.MAX_PARTS``; 1024 before it
existed)."""
BROKEN = image_uri(b"not an image at all")
ANSWER_WITHIN = 2.0
RSS_BOUND = 64 * MiB

INTEGER_FIELDS = {
    "/send": ("part_idx", "buffer_address", "receive_count", "embedding_port"),
    "/scheduler_receive_meta_data": ("part_idx", "receive_count"),
    "/encode": ("num_parts", "part_idx", "receive_count", "embedding_port", "embedding_port[]"),
}


def _numbers(body: dict[str, Any]) -> dict[str, Any]:
    """The integer fields of ``body``, a huge one shown as its size."""
    return {
        key: f"2**{abs(value).bit_length() - 1}"
        if isinstance(value, int) and abs(value) >= 2**64
        else value
        for key, value in body.items()
        if key in ("num_parts", "part_idx", "receive_count", "buffer_address", "embedding_port")
    }


def _dumps(body: dict[str, Any]) -> str:
    """``json.dumps``, for integers of any number of digits."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.dumps(body)
    finally:
        sys.set_int_max_str_digits(limit)


async def post_raw(http: httpx.AsyncClient, route: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` as JSON text (Python's ``json`` writes integers of any size); it must be
    answered within :data:`ANSWER_WITHIN` seconds."""
    started = time.monotonic()
    try:
        response = await http.post(
            route, content=_dumps(body), headers={"Content-Type": "application/json"}
        )
    except httpx.TimeoutException:
        raise AssertionError(f"{route} {_numbers(body)}: no answer within 10 s") from None
    elapsed = time.monotonic() - started
    assert elapsed < ANSWER_WITHIN, f"{route} {_numbers(body)} took {elapsed:.2f} s to answer"
    return response


def _loads(raw: bytes) -> Any:
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.loads(raw)
    finally:
        sys.set_int_max_str_digits(limit)


def refused(response: httpx.Response, status: int = 400) -> None:
    body = _loads(response.request.content)
    assert response.status_code == status, (
        f"{response.request.url.path} {_numbers(body)}: {response.status_code} "
        f"{response.text[:300]}"
    )
    problem = contract_error(response.status_code, response.json())
    assert problem is None, problem


async def huge_integers(server: Server, honest: Honest, values: list[int]) -> int:
    """Every integer field of every route set to each of ``values``, each in a body that is
    otherwise a live request's (so nothing but the number is wrong). Returns how many."""
    live = f"numbers-live-{time.monotonic_ns()}"
    encoded = await honest.client.encode(live, [image_uri(honest.reference.fresh_png())])
    slot = honest.pool.allocate(encoded.embedding_size)
    base: dict[str, dict[str, Any]] = {
        "/encode": {"req_id": f"{live}-x_local_part_0", "mm_items": [BROKEN]},
        "/send": {
            "req_id": live,
            "session_id": honest.pool.session_id,
            "buffer_address": slot.address,
        },
        "/scheduler_receive_meta_data": {"req_id": live},
    }
    sent = 0
    # A live completion endpoint: a message to it would be packed and sent.
    with Pull() as pull:
        endpoint = {"prefill_host": "127.0.0.1", "embedding_port": pull.port}
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            for route, fields in INTEGER_FIELDS.items():
                for field in fields:
                    for value in values:
                        body = {**base[route], **endpoint}
                        if field == "embedding_port[]":
                            body["embedding_port"] = [pull.port, value]
                        else:
                            body[field] = value
                        refused(await post_raw(http, route, body))
                        sent += 1
    # The live request is still whole: its one receiver gets its bytes.
    answer = await honest.client.post("/send", base["/send"])
    slot.verify(answer["embedding_size"], answer["checksum"])
    slot.release()
    return sent


async def test_integers_of_2_to_the_2100_get_400(server: Server, honest: Honest) -> None:
    sent, _ = await withstand(
        server, honest, lambda: huge_integers(server, honest, [HUGE, -HUGE]), rss_bound=RSS_BOUND
    )
    assert sent == 22


@pytest.mark.hostile
async def test_integers_of_every_size_get_400(server: Server, honest: Honest) -> None:
    # From just past 64 bits to past the 4300 digits Python's int() parses by default.
    values = [2**bits * sign for bits in (64, 65, 128, 1000, 4000, 15000) for sign in (1, -1)]
    await withstand(
        server, honest, lambda: huge_integers(server, honest, values), rss_bound=RSS_BOUND
    )


async def failing_parts(server: Server, rids: int, num_parts: int, status: int) -> None:
    """``rids`` failing ``/encode`` calls, each naming ``num_parts`` parts."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        for rid in range(rids):
            for part in (0, num_parts - 1):
                body = {
                    "req_id": f"parts-{num_parts}-{rid}_local_part_{part}",
                    "mm_items": [BROKEN],
                    "num_parts": num_parts,
                    "part_idx": part,
                }
                response = await post_raw(http, "/encode", body)
                refused(response, status)
                if num_parts > MAX_PARTS:
                    assert "num_parts" in response.json()["message"]


async def test_three_million_parts_are_refused_by_the_bound(server: Server, honest: Honest) -> None:
    await withstand(
        server, honest, lambda: failing_parts(server, 1, 3_000_000, 400), rss_bound=RSS_BOUND
    )


async def test_a_failing_encode_of_the_most_parts_keeps_livez_fast(
    server: Server, honest: Honest
) -> None:
    await withstand(
        server, honest, lambda: failing_parts(server, 3, MAX_PARTS, 400), rss_bound=RSS_BOUND
    )


@pytest.mark.hostile
async def test_a_hundred_failing_encodes_of_the_most_parts(server: Server, honest: Honest) -> None:
    await withstand(
        server, honest, lambda: failing_parts(server, 100, MAX_PARTS, 400), rss_bound=RSS_BOUND
    )
