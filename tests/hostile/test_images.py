"""Case 4: images that are small on the wire and costly to decode (built in
:mod:`hostile.images`).

Each must be refused fast (400, within :data:`REFUSE_WITHIN`), from what its header and
structure declare, before pixels are decoded; an honest rank's 32x32 PNG ``/encode`` + ``/send``
beside them still answers within :data:`~hostile.rig.HONEST_BOUND`. Measured on main before
the fix: the JPEG and the WebP were decoded and answered 200 (each costing what
:mod:`hostile.images` says), the PNG was read chunk by chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
import trio

from hostile.images import chunk_flood_png, many_frames_webp, scan_bomb_jpeg
from hostile.rig import Honest, MiB, Server, contract_error, withstand
from trio_encode.testing.images import image_uri

REFUSE_WITHIN = 2.0
RSS_BOUND = 192 * MiB
"""Besides the bodies themselves (the PNG's is 16 MB of base64, held a few times over while
it is parsed), nothing: no image is decoded."""

BOMBS: dict[str, Callable[[], str]] = {
    "progressive JPEG, 6000x6000, 2,000 empty scans": lambda: image_uri(
        scan_bomb_jpeg(), "image/jpeg"
    ),
    "PNG, 1,000,000 empty chunks before its pixels": lambda: image_uri(
        chunk_flood_png(), "image/png"
    ),
    "animated WebP, 2,000 frames on a 6000x6000 canvas": lambda: image_uri(
        many_frames_webp(), "image/webp"
    ),
}


async def refuse_each(server: Server, copies: int) -> dict[str, list[float]]:
    """``copies`` of every bomb at once, each its own ``/encode``; each must get 400 within
    :data:`REFUSE_WITHIN` seconds. Returns the seconds each took, by bomb."""
    items = {name: make() for name, make in BOMBS.items()}
    took: dict[str, list[float]] = {name: [] for name in BOMBS}

    async def one(http: httpx.AsyncClient, name: str, index: int) -> None:
        started = time.monotonic()
        body = {"req_id": f"bomb-{index}-{time.monotonic_ns()}", "mm_items": [items[name]]}
        try:
            response = await http.post("/encode", json=body)
        except httpx.TimeoutException:
            raise AssertionError(f"{name}: no answer within 30 s") from None
        elapsed = time.monotonic() - started
        assert response.status_code == 400, (name, response.status_code, response.text[:300])
        assert contract_error(400, response.json()) is None, response.text[:300]
        took[name].append(elapsed)

    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        for name in BOMBS:
            for index in range(copies):
                nursery.start_soon(one, http, name, index)
    slow = {name: max(seconds) for name, seconds in took.items() if max(seconds) >= REFUSE_WITHIN}
    assert not slow, f"refused, but not within {REFUSE_WITHIN} s: {slow}"
    return took


async def test_image_bombs_are_refused_fast(server: Server, honest: Honest) -> None:
    await withstand(server, honest, lambda: refuse_each(server, 1), rss_bound=RSS_BOUND)


@pytest.mark.hostile
async def test_image_bombs_four_at_a_time_three_times(server: Server, honest: Honest) -> None:
    async def rounds() -> None:
        for _ in range(3):
            await refuse_each(server, 4)

    await withstand(server, honest, rounds, rss_bound=2 * RSS_BOUND)
