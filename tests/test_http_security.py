"""Attacks on a real server, one per way in; each fails against a server without its defence.

The server runs with real Mooncake engines on loopback, the real encoder where the attack is
on the encoder's front (fetches, files, pixels) and the stand-in where it is on the request
lifecycle. Every attack is answered in the contract's error shape (never a 500), and leaves
nothing behind.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio

from support.cluster import start_master
from support.engines import DEAD_SESSION, RankEngines
from support.harness import Harness, http_server, landing_pools
from support.models import SMALL
from support.web_server import web_server
from trio_encode.client import LandingPool, LandingSlot, metric_value
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder import backend as backend_module
from trio_encode.encoder.cache import content_key
from trio_encode.encoder.fetch import FetchPolicy
from trio_encode.encoder.images import load_item
from trio_encode.encoder.store import _HEADER, MooncakeEmbeddingStore, store_key
from trio_encode.engine import Write
from trio_encode.logs import KeyValueFormatter
from trio_encode.receivers import ReceiverPolicy
from trio_encode.server import app as app_module
from trio_encode.server.metrics import Metrics
from trio_encode.settings import ServerSettings
from trio_encode.testing.images import image_uri, noise_uri, solid_image
from trio_encode.testing.stand_in_encoder import StandInEncoder, embedding_size

ITEM = image_uri(b"an image")
ROW = 16 * 256 * 4
"""Bytes of one image's embedding with the small real model."""


def png(side: int, seed: int = 0) -> bytes:
    return solid_image(side, side, (seed % 256, 7, 9))


async def post(harness: Harness, path: str, body: Any) -> httpx.Response:
    """POST ``body``: bytes as they are, an async iterator streamed (chunked), else as JSON."""
    async with httpx.AsyncClient(base_url=harness.running.url, timeout=60) as http:
        if isinstance(body, dict):
            return await http.post(path, json=body)
        return await http.post(path, content=body)


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert body["status"] == "error", body
    return response.status_code, body["error"], body["message"]


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll for ``condition`` (made true by a worker thread or another process)."""
    with trio.fail_after(seconds):
        while True:
            if condition():
                return
            await trio.sleep(0.05)


def fetching_encoder(**settings: Any) -> ImageEncoder:
    return ImageEncoder.from_settings(
        replace(SMALL, remote_fetch=True, remote_private_networks=("127.0.0.0/8",), **settings)
    )


# -- every limit before the work ---------------------------------------------------------------


async def test_more_images_than_allowed_are_refused_before_any_is_fetched(
    rank_engines: RankEngines,
) -> None:
    encoder = fetching_encoder(queue_size=8)
    async with web_server() as web, http_server(rank_engines.server, encoder=encoder) as harness:
        web.routes["/a.png"] = (200, {}, png(8))
        items = [web.url("/a.png") for _ in range(9)]
        answer = await post(harness, "/encode", {"req_id": "many", "mm_items": items})
        assert error_of(answer)[:2] == (400, "invalid_input")
        assert "9 images in one request; this server accepts at most 8" in error_of(answer)[2]
        assert web.requests == [], "nothing fetched"
        await harness.settled()


async def test_a_request_reads_only_what_is_left_of_its_byte_budget(
    rank_engines: RankEngines, tmp_path: Path
) -> None:
    """Five distinct 1-image files, a budget for two and a half: refused at the third file.
    One file named many times is read once and fits."""
    files = [png(64, seed) for seed in range(5)]
    for index, data in enumerate(files):
        (tmp_path / f"{index}.png").write_bytes(data)
    budget = len(files[0]) * 5 // 2
    encoder = ImageEncoder.from_settings(
        replace(SMALL, media_dir=tmp_path, max_request_bytes=budget)
    )
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, 8 * ROW) as pools,
    ):
        names = [f"{index}.png" for index in range(5)]
        answer = await post(harness, "/encode", {"req_id": "five", "mm_items": names})
        status, kind, message = error_of(answer)
        assert (status, kind) == (400, "invalid_input")
        assert message.startswith("mm_items[2]: the request's images are more than")
        assert "max_request_bytes" in message
        encoded = await harness.client.encode("same", ["0.png"] * 6, receive_count=1)
        assert encoded.embedding_size == 6 * ROW
        await harness.client.send("same", pools[0].session_id, pools[0].address)
        await harness.settled()


async def test_a_request_s_pixels_are_counted_from_headers_before_any_decode(
    rank_engines: RankEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real_decode = backend_module.decode_image

    def counting_decode(*args: Any, **kwargs: Any) -> torch.Tensor:
        decoded.append(1)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(backend_module, "decode_image", counting_decode)
    encoder = ImageEncoder.from_settings(replace(SMALL, max_request_pixels=2 * 64 * 64))
    async with http_server(rank_engines.server, encoder=encoder) as harness:
        items = [image_uri(png(64, seed)) for seed in range(3)]
        decoded.clear()  # the warm-up's own
        answer = await post(harness, "/encode", {"req_id": "pixels", "mm_items": items})
        status, kind, message = error_of(answer)
        assert (status, kind) == (400, "invalid_input")
        assert message.startswith("mm_items[2]: the request's images have more than 8192 pixels")
        assert decoded == [], "no image was decoded"
        await harness.settled()


async def test_live_requests_are_capped_and_the_cap_says_when_to_retry(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(rank_engines.server, max_live_scopes=2) as harness,
        landing_pools(rank_engines, 4 * embedding_size(1)) as pools,
    ):
        for req_id in ("a", "b"):
            await harness.client.encode(req_id, [image_uri(req_id)], receive_count=1)
        answer = await post(harness, "/encode", {"req_id": "c", "mm_items": [image_uri("c")]})
        status, kind, message = error_of(answer)
        assert (status, kind, answer.headers["Retry-After"]) == (503, "overloaded", "1")
        assert "max_live_scopes" in message
        pool = pools[0]
        await harness.client.send("a", pool.session_id, pool.allocate(embedding_size(1)).address)
        # Its 200 comes once the bytes landed; the scope then releases, and only then is its
        # place free (a retry after Retry-After finds it so).
        scope = harness.running.service.registry.live("a")
        if scope is not None:
            with trio.fail_after(5):
                await scope.wait_ended()
        await harness.client.encode("c", [image_uri("c")], receive_count=1)
        for req_id in ("b", "c"):
            slot = pool.allocate(embedding_size(1))
            await harness.client.send(req_id, pool.session_id, slot.address)
        await harness.settled()


async def test_bytes_held_by_live_requests_are_capped(rank_engines: RankEngines) -> None:
    async with (
        http_server(rank_engines.server, max_held_bytes=embedding_size(1)) as harness,
        landing_pools(rank_engines, 2 * embedding_size(1)) as pools,
    ):
        await harness.client.encode("a", [image_uri("a")], receive_count=1)
        answer = await post(harness, "/encode", {"req_id": "b", "mm_items": [image_uri("b")]})
        assert error_of(answer)[:2] == (503, "overloaded")
        assert "max_held_bytes" in error_of(answer)[2]
        await harness.client.send("a", pools[0].session_id, pools[0].address)
        await harness.settled()


async def test_a_row_shared_through_the_cache_is_held_once(rank_engines: RankEngines) -> None:
    """Requests that send one cached row share one allocation: ``max_held_bytes`` counts it
    once, however many requests (or copies in one request) hold it, and still counts every
    other row."""
    encoder = ImageEncoder.from_settings(SMALL)
    shared, other = noise_uri(21), noise_uri(22)
    async with (
        http_server(rank_engines.server, encoder=encoder, max_held_bytes=2 * ROW) as harness,
        landing_pools(rank_engines, 64 * ROW) as pools,
    ):
        service = harness.running.service
        await harness.client.encode("a", [shared], receive_count=1)
        await harness.client.encode("b", [shared], receive_count=1)
        await harness.client.encode("c", [shared] * 64, receive_count=1)
        assert service.held_bytes == ROW
        await harness.client.encode("d", [other], receive_count=1)
        assert service.held_bytes == 2 * ROW
        answer = await post(harness, "/encode", {"req_id": "e", "mm_items": [shared]})
        assert error_of(answer)[:2] == (503, "overloaded")
        for req_id in ("a", "b", "c", "d"):
            await harness.client.send(req_id, pools[0].session_id, pools[0].address)
        await harness.settled()
        assert service.held_bytes == 0


async def test_the_held_bytes_check_does_not_visit_every_live_request(
    rank_engines: RankEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_held_bytes`` is checked on every /encode: a running total, not a pass over the
    live requests (counted: no live request's scope is listed for it)."""
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        service = harness.running.service
        for req_id in (f"live-{index}" for index in range(20)):
            await harness.client.encode(req_id, [image_uri(req_id)], receive_count=1)
        listed = 0
        scopes = service.registry.scopes

        def counted() -> list[Any]:
            nonlocal listed
            listed += 1
            return scopes()

        monkeypatch.setattr(service.registry, "scopes", counted)
        await harness.client.encode("one-more", [image_uri("one-more")], receive_count=1)
        assert listed == 0
        assert service.held_bytes == 21 * embedding_size(1)
        monkeypatch.undo()
        for index in range(20):
            await harness.client.send(f"live-{index}", pools[0].session_id, pools[0].address)
        await harness.client.send("one-more", pools[0].session_id, pools[0].address)
        await harness.settled()


async def test_only_encode_takes_large_bodies(rank_engines: RankEngines) -> None:
    """/send and pulls take kilobytes, whether the body declares its length or streams it."""
    big = json.dumps({"req_id": "x", "pad": "a" * 100_000}).encode()

    async def streamed() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b" " * 10_000

    async with http_server(rank_engines.server, shutdown_grace=0) as harness:
        for route in ("/send", "/scheduler_receive_meta_data"):
            for body in (big, streamed()):
                status, kind, message = error_of(await post(harness, route, body))
                assert (status, kind) == (413, "too_large")
                assert message == f"{route} takes bodies of at most 65536 bytes"
        # The same size is fine where images travel.
        answer = await post(
            harness, "/encode", {"req_id": "e", "mm_items": [ITEM], "p": "a" * 100_000}
        )
        assert answer.status_code == 200, answer.text
        await harness.running.service.shutdown()


def test_body_limits_reach_into_no_private_state_of_quart() -> None:
    """A private attribute of Quart's (its body's buffer bound) can change in any release, and
    the per-route limit would silently fall back to ``max_body_bytes``: the server code uses
    Quart's public interface and an ASGI middleware of its own only."""
    server = Path(app_module.__file__).parent
    private = re.compile(
        r"\b(?:request|g|current_app|app)(?:\.[a-z]\w*)*\._[a-z]|getattr\(\w+[.\w]*, \"_"
    )
    for source in sorted(server.glob("*.py")):
        found = private.findall(source.read_text())
        assert not found, f"{source.name}: {found}"


async def test_heavy_unknown_fields_and_deep_nesting_are_refused_not_parsed(
    rank_engines: RankEngines,
) -> None:
    async with http_server(rank_engines.server) as harness:
        base = {"req_id": "h", "mm_items": [ITEM]}
        for body in (
            json.dumps(base | {"hashes": [{}] * 200_000}).encode(),
            json.dumps(base | {"junk": list(range(200_000))}).encode(),
            b'{"req_id": "h", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ):
            started = time.perf_counter()
            status, kind, message = error_of(await post(harness, "/encode", body))
            assert (status, kind) == (400, "invalid_input")
            assert "JSON values; at most 4096 are accepted" in message
            assert time.perf_counter() - started < 1.0
        # Under the value cap, nesting deeper than the parser recurses is a 400, never a 500.
        deep = b'{"req_id": "h", "time_stats_json": ' + b"[" * 3000 + b"]" * 3000 + b"}"
        status, kind, message = error_of(await post(harness, "/encode", deep))
        assert (status, kind, message) == (
            400,
            "invalid_input",
            "the body's JSON is nested too deeply",
        )
        # SGLang's hashes: numbers or short strings, one per item; objects are refused.
        answer = await post(harness, "/encode", base | {"hashes": [{"a": 1}]})
        assert error_of(answer)[:2] == (400, "invalid_input")
        answer = await post(harness, "/encode", base | {"receive_count": 1025})
        assert "less than or equal to 1024" in error_of(answer)[2]
        await harness.settled()


async def test_many_copies_of_one_cached_image_are_sent_as_they_lie(
    rank_engines: RankEngines,
) -> None:
    """Without an arena, 64 copies of one image are 64 (address, length) pairs of one row, not
    a concatenated copy of 64 rows; the rank still gets all 64, and one registration covers
    them."""
    encoder = ImageEncoder.from_settings(SMALL)
    image = noise_uri(5)
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, 64 * ROW) as pools,
    ):
        encoded = await harness.client.encode("copies", [image] * 64, receive_count=1)
        assert encoded.embedding_size == 64 * ROW
        scope = harness.running.service.registry.live("copies")
        assert scope is not None
        assert scope._embedding is not None
        segments = list(scope._embedding.segments)
        assert len(segments) == 64
        assert len(set(segments)) == 1, "one row, named 64 times"
        slot = pools[0].allocate(64 * ROW)
        sent = await harness.client.send("copies", pools[0].session_id, slot.address)
        slot.verify(sent.embedding_size, sent.checksum)
        rows = slot.read(64 * 16, 256, "float32").view(64, 16, 256)
        assert all(torch.equal(rows[0], rows[i]) for i in range(64))
        text = await harness.settled()
    assert metric_value(text, "registrations_total") == 1


async def test_decode_threads_are_shared_image_by_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests of many images hold both decode threads; a one-image request that comes
    after them is decoded after at most one image of each, not after either whole request."""

    def slow_decode(data: bytes, preprocess: Any, *, max_pixels: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.zeros(3, preprocess.image_size, preprocess.image_size)

    monkeypatch.setattr(backend_module, "decode_image", slow_decode)
    encoder = ImageEncoder.from_settings(replace(SMALL, cache_bytes=0, warmup=False))
    done: dict[str, float] = {}

    async def request(name: str, images: int) -> None:
        await encoder.encode([f"{name}-{i}".encode() for i in range(images)])
        done[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        async with trio.open_nursery() as clients:
            clients.start_soon(request, "big-1", 12)
            clients.start_soon(request, "big-2", 12)
            await trio.sleep(0.02)
            clients.start_soon(request, "small", 1)
        nursery.cancel_scope.cancel()
    assert done["small"] < min(done["big-1"], done["big-2"]), done


# -- fetch without decoding ----------------------------------------------------------------------


async def test_a_compressed_answer_is_refused_without_inflating_it(
    rank_engines: RankEngines,
) -> None:
    """A small gzip body that inflates to 64 MiB: refused from its header, never inflated."""
    bomb = gzip.compress(gzip.compress(b"\0" * (64 << 20)))
    encoder = fetching_encoder()
    async with web_server() as web, http_server(rank_engines.server, encoder=encoder) as harness:
        web.routes["/bomb.png"] = (200, {"Content-Encoding": "gzip, gzip"}, bomb)
        answer = await post(
            harness, "/encode", {"req_id": "bomb", "mm_items": [web.url("/bomb.png")]}
        )
        status, kind, message = error_of(answer)
        assert (status, kind) == (400, "invalid_input")
        assert "answered with Content-Encoding 'gzip, gzip'" in message
        assert b"accept-encoding: identity" in web.heads[0].lower()
        await harness.settled()


def test_translated_ipv6_forms_are_refused_and_mapped_ones_unwrapped() -> None:
    import ipaddress

    policy = FetchPolicy.build(
        enabled=True,
        hosts=(),
        private_networks=("10.0.0.0/8",),
        max_bytes=1,
        timeout=1,
        max_redirects=0,
    )
    for refused in (
        "64:ff9b::a00:1",
        "64:ff9b::808:808",
        "64:ff9b:1::808:808",
        "2002:808:808::1",
        "::8.8.8.8",
        "::10.1.2.3",
    ):
        assert not policy.address_allowed(ipaddress.ip_address(refused)), refused
    for allowed in ("::ffff:8.8.8.8", "::ffff:10.1.2.3", "10.1.2.3", "8.8.8.8", "2606:4700::1111"):
        assert policy.address_allowed(ipaddress.ip_address(allowed)), allowed


# -- the engine is not a public surface ------------------------------------------------------------


async def test_no_unauthenticated_route_and_no_error_shows_the_engine_or_an_address(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(rank_engines.server, token="t0ken") as harness,
        landing_pools(rank_engines, embedding_size(1)) as pools,
        httpx.AsyncClient(base_url=harness.running.url) as http,
    ):
        engine_port = rank_engines.server.session_id.rpartition(":")[2]
        for route in ("/health", "/readyz", "/livez", "/metrics"):
            answer = await http.get(route)
            assert answer.status_code == 200
            assert rank_engines.server.session_id not in answer.text, route
            assert f":{engine_port}" not in answer.text, route
        await harness.client.encode("r", [ITEM], receive_count=1)
        failed = await http.post(
            "/send",
            json={"req_id": "r", "session_id": DEAD_SESSION, "buffer_address": 4096},
            headers={"Authorization": "Bearer t0ken"},
        )
        status, kind, message = error_of(failed)
        assert (status, kind) == (502, "engine_failed")
        assert "0x" not in failed.text
        assert rank_engines.server.session_id not in failed.text
        assert re.match(
            rf"transfer engine transfer failed with code -\d+, receiver {DEAD_SESSION}", message
        )
        await harness.client.send("r", pools[0].session_id, pools[0].address)
        await harness.settled()


POISON = b"\x07" * ROW
"""What a stranger writes over a cached row."""


async def _write_as_a_stranger(rank_engines: RankEngines, address: int) -> None:
    """:data:`POISON` written at ``address`` of the server's engine by a plain Mooncake client
    that knows only the engine's address (one of the rank engines, not a receiver of it)."""
    poison = torch.frombuffer(bytearray(POISON), dtype=torch.uint8)
    await rank_engines.ranks[1].transfer(
        Write(rank_engines.server.session_id, [(poison.data_ptr(), ROW)], address)
    )


async def _served_as_computed(
    harness: Harness, pool: LandingPool, image: str, checksum: int, first: LandingSlot
) -> None:
    """A new request for ``image`` gets the model's embedding (``checksum``, the bytes
    ``first`` received before the write), not the written bytes."""
    again = await harness.client.encode("again", [image], receive_count=1)
    assert again.checksum == checksum
    second = pool.allocate(ROW)
    sent = await harness.client.send("again", pool.session_id, second.address)
    second.verify(sent.embedding_size, sent.checksum)
    assert second.raw()[:ROW].tolist() == first.raw()[:ROW].tolist()


async def test_an_engine_write_into_the_arena_is_detected_and_never_served(
    rank_engines: RankEngines,
) -> None:
    """A plain Mooncake client that knows only the server engine's address overwrites a
    cached image's segment in the arena. The next request for that image gets the embedding
    the model computes, not the written bytes; the segment is dropped and counted."""
    observed = Metrics()
    encoder = ImageEncoder.from_settings(replace(SMALL, arena_bytes=1 << 20), observer=observed)
    image = noise_uri(11)
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, 2 * ROW) as pools,
    ):
        pool = pools[0]
        clean = await harness.client.encode("clean", [image], receive_count=1)
        first = pool.allocate(ROW)
        await harness.client.send("clean", pool.session_id, first.address)
        assert encoder.arena is not None
        (segment,) = encoder.arena._cached.values()
        await _write_as_a_stranger(rank_engines, segment.address)
        assert bytes(segment.buffer[:8]) == POISON[:8], "the write landed in the arena"

        await _served_as_computed(harness, pool, image, clean.checksum, first)
        await harness.settled()
    assert (
        metric_value(observed.render().decode(), "encoder_cache_poisoned_total", source="arena")
        == 1
    )


async def test_an_engine_write_into_a_registered_cached_row_is_never_served(
    rank_engines: RankEngines,
) -> None:
    """Without an arena (``--arena-bytes 0``) a cached row is registered with the engine only
    while a request sends it. Request ``held`` has two receivers and has been sent to one, so
    its row, the cached tensor itself, stays registered until the second: a plain Mooncake
    client that knows only the server engine's address writes into it meanwhile (a real write
    through the engine's port, made deterministic by the request that holds the row). The next
    request for that image gets the model's embedding, not the written bytes; the entry is
    dropped and counted."""
    observed = Metrics()
    encoder = ImageEncoder.from_settings(SMALL, observer=observed)
    image = noise_uri(12)
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, 3 * ROW) as pools,
    ):
        pool = pools[0]
        held = await harness.client.encode("held", [image], receive_count=2)
        first = pool.allocate(ROW)
        await harness.client.send("held", pool.session_id, first.address)
        scope = harness.running.service.registry.live("held")
        assert scope is not None
        assert scope._embedding is not None
        ((address, nbytes),) = scope._embedding.segments
        assert encoder.cache is not None
        (cached,) = encoder.cache._entries.values()
        assert (cached.data_ptr(), nbytes) == (address, ROW), "the request sends the cached row"
        await _write_as_a_stranger(rank_engines, address)
        assert bytes(cached.view(torch.uint8).numpy().data)[:8] == POISON[:8], "it landed"

        await _served_as_computed(harness, pool, image, held.checksum, first)
        await harness.client.send("held", pool.session_id, pool.allocate(ROW).address)
        await harness.settled()
    text = observed.render().decode()
    assert metric_value(text, "encoder_cache_poisoned_total", source="cache") == 1


async def test_a_store_entry_whose_bytes_were_overwritten_is_never_served(
    rank_engines: RankEngines, tmp_path: Path
) -> None:
    """A stranger's Mooncake Store client, connected to the cluster's real master, reads the
    entry this encoder stored and writes it back with other row bytes under the checksum
    stored with it (what a write into the store's memory leaves). The encoder keeps nothing
    locally, so the next request reads that entry: it does not match, is removed and counted,
    and the image is encoded again; the request after that is a clean store hit."""
    from mooncake.store import MooncakeDistributedStore

    master = start_master(tmp_path)
    stranger = MooncakeDistributedStore()
    try:
        observed = Metrics()
        settings = replace(
            SMALL,
            cache_bytes=0,
            store_master=master.address,
            store_segment_bytes=16 << 20,
            store_buffer_bytes=16 << 20,
            store_wait=5.0,
        )
        store = MooncakeEmbeddingStore.from_settings(
            settings, hostname="127.0.0.1", protocol="tcp", device="", observer=observed
        )
        encoder = ImageEncoder.from_settings(settings, observer=observed, store=store)
        setup = partial(stranger.setup, "127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp")
        assert await trio.to_thread.run_sync(setup, "", master.address) == 0
        image = noise_uri(13)
        data = load_item(image, max_bytes=SMALL.max_image_bytes)
        key = store_key(encoder.model.fingerprint, content_key(encoder.model.model_id, data))

        def count(name: str, **labels: str) -> float:
            return metric_value(observed.render().decode(), name, **labels)

        async with (
            http_server(rank_engines.server, encoder=encoder) as harness,
            landing_pools(rank_engines, 3 * ROW) as pools,
        ):
            await until(lambda: store.connected, 30)
            pool = pools[0]
            clean = await harness.client.encode("first", [image], receive_count=1)
            first = pool.allocate(ROW)
            await harness.client.send("first", pool.session_id, first.address)
            await until(lambda: count("store_puts_total", result="stored") == 1)
            entry = await trio.to_thread.run_sync(stranger.get, key)
            assert len(entry) == 8 + _HEADER + ROW
            overwritten = entry[: 8 + _HEADER] + b"\x07" * ROW
            written = await trio.to_thread.run_sync(stranger.upsert, key, overwritten)
            assert written == 0

            again = await harness.client.encode("again", [image], receive_count=1)
            assert again.checksum == clean.checksum
            second = pool.allocate(ROW)
            sent = await harness.client.send("again", pool.session_id, second.address)
            second.verify(sent.embedding_size, sent.checksum)
            assert second.raw()[:ROW].tolist() == first.raw()[:ROW].tolist()
            assert count("store_lookups_total", result="poisoned") == 1
            assert count("encoder_cache_poisoned_total", source="store") == 1
            assert count("encoder_batch_size_sum") == 2, "encoded again"

            # The entry was removed, so the new one is stored.
            await until(lambda: count("store_puts_total", result="stored") == 2)
            await harness.client.encode("third", [image], receive_count=1)
            third = pool.allocate(ROW)
            sent = await harness.client.send("third", pool.session_id, third.address)
            assert third.raw()[:ROW].tolist() == first.raw()[:ROW].tolist()
            assert count("store_lookups_total", result="hit") == 1
            assert count("encoder_batch_size_sum") == 2, "served from the store"
            await harness.settled()
    finally:
        await trio.to_thread.run_sync(stranger.close)
        master.stop()


# -- receivers are authorised ---------------------------------------------------------------------


async def test_a_receiver_outside_the_allowed_hosts_is_refused(rank_engines: RankEngines) -> None:
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        await harness.client.encode("r", [ITEM], receive_count=1)
        for session_id in ("10.1.2.3:15000", "rank-7.cluster:15000", "[64:ff9b::7f00:1]:15000"):
            answer = await post(
                harness, "/send", {"req_id": "r", "session_id": session_id, "buffer_address": 4096}
            )
            status, kind, message = error_of(answer)
            assert (status, kind) == (403, "receiver_not_allowed"), session_id
            assert "allowed_receivers" in message
        # The request is untouched: its real receiver is served.
        await harness.client.send("r", pools[0].session_id, pools[0].address)
        text = await harness.settled()
    assert metric_value(text, "engine_errors_total") == 0, "the engine contacted nobody else"


def test_the_receiver_allow_list_matches_networks_names_and_mapped_addresses() -> None:
    policy = ReceiverPolicy.build(("10.0.0.0/8", "Rank-0.cluster.", "fd00::/8"))
    for host in (
        "127.0.0.1",
        "127.9.9.9",
        "::1",
        "localhost",
        "10.1.2.3",
        "::ffff:10.1.2.3",
        "rank-0.cluster",
        "fd00::5",
        "::ffff:127.0.0.1",
    ):
        assert policy.allows(host), host
    for host in (
        "11.0.0.1",
        "rank-1.cluster",
        "64:ff9b::a01:203",
        "2002:a01:203::1",
        "::10.1.2.3",
        "0.0.0.0",
        "::",
    ):
        assert not policy.allows(host), host
    assert ReceiverPolicy.build(("*",)).allows("203.0.113.9")
    assert not ReceiverPolicy().allows("203.0.113.9")
    with pytest.raises(ValueError, match="not a CIDR network"):
        ServerSettings.exactly(allowed_receivers="10.0.0.0/33")


async def test_a_send_from_another_host_than_the_prefill_host_is_refused(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(
            rank_engines.server, allowed_receivers="10.0.0.0/8", shutdown_grace=0
        ) as harness,
        landing_pools(rank_engines, 2 * embedding_size(1)) as pools,
    ):
        pool = pools[0]
        await harness.client.encode("elsewhere", [ITEM], prefill_host="10.9.9.9")
        answer = await post(
            harness,
            "/send",
            {"req_id": "elsewhere", "session_id": pool.session_id, "buffer_address": pool.address},
        )
        status, kind, message = error_of(answer)
        assert (status, kind) == (403, "receiver_host_mismatch")
        assert "prefill_host '10.9.9.9'" in message
        await harness.client.encode("here", [ITEM], prefill_host="127.0.0.1")
        slot = pool.allocate(embedding_size(1))
        await harness.client.send("here", pool.session_id, slot.address)
        await harness.running.service.shutdown()
    async with (
        http_server(rank_engines.server, receivers_match_prefill_host=False) as harness,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        await harness.client.encode("multi-node", [ITEM], prefill_host="10.9.9.9")
        await harness.client.send("multi-node", pools[0].session_id, pools[0].address)
        await harness.settled()


async def test_a_client_s_sends_in_flight_are_capped(rank_engines: RankEngines) -> None:
    """With a cap of one, a client's second /send while its first waits (for a slow encode)
    is refused; once the first has answered, the second goes through."""
    slow = {"req_id": "s", "mm_items": [image_uri(b"SLOW image")], "receive_count": 2}
    async with (
        http_server(
            rank_engines.server, encoder=StandInEncoder(slow_seconds=1.0), max_sends_per_client=1
        ) as harness,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        first, second = (
            {"req_id": "s", "session_id": pool.session_id, "buffer_address": pool.address}
            for pool in pools[:2]
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, harness, "/encode", slow)
            await trio.sleep(0.1)
            nursery.start_soon(post, harness, "/send", first)
            await trio.sleep(0.2)
            answer = await post(harness, "/send", second)
            status, kind, message = error_of(answer)
            assert (status, kind) == (503, "overloaded")
            assert answer.headers["Retry-After"] == "1"
            assert "max_sends_per_client" in message
        assert (await post(harness, "/send", second)).status_code == 200
        await harness.settled()


# -- smaller ------------------------------------------------------------------------------------


async def test_req_ids_cannot_split_log_lines_or_send_terminal_escapes(
    rank_engines: RankEngines, caplog: pytest.LogCaptureFixture
) -> None:
    hostile = "r\r\n level=ERROR fake=1 \x1b[2J\x00\u2028end"
    formatter = KeyValueFormatter()
    with caplog.at_level(logging.INFO):
        async with http_server(rank_engines.server) as harness:
            await post(harness, "/encode", {"req_id": hostile, "mm_items": ["nope"]})
            await harness.settled()
    lines = [
        formatter.format(record)
        for record in caplog.records
        if getattr(record, "req_id", None) == hostile
    ]
    assert lines, "the request was logged"
    for line in lines:
        assert not any(c in line for c in "\r\n\x1b\x00\u2028"), line
        for escaped in ("\\r\\n", "\\u001b", "\\u0000", "\\u2028"):
            assert escaped in line


async def test_a_pull_shows_sizes_but_not_the_checksum(rank_engines: RankEngines) -> None:
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        await harness.client.encode("p", [ITEM], receive_count=1)
        pulled = await harness.client.post("/scheduler_receive_meta_data", {"req_id": "p"})
        assert pulled["embedding_size"] == embedding_size(1)
        assert "checksum" not in pulled
        await harness.client.send("p", pools[0].session_id, pools[0].address)
        await harness.settled()


def test_the_token_can_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    assert ServerSettings.exactly(token_file=path).token == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        ServerSettings.exactly(token_file=path, token="other")
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ServerSettings.exactly(token_file=path)


def test_engine_ports_open_on_every_interface_are_found_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start-up check that names the transfer engine's ports listening on all interfaces
    (Mooncake binds them so, whatever its hostname): a socket on 0.0.0.0 is found and logged,
    one on loopback is found and not logged."""
    import socket

    from trio_encode.server.listeners import listening_sockets
    from trio_encode.server.serve import warn_open_engine_ports

    before = listening_sockets()
    with socket.socket() as wide, socket.socket() as narrow:
        wide.bind(("0.0.0.0", 0))
        narrow.bind(("127.0.0.1", 0))
        wide.listen()
        narrow.listen()
        opened = listening_sockets() - before
        wide_port, narrow_port = wide.getsockname()[1], narrow.getsockname()[1]
    assert opened == {("0.0.0.0", wide_port), ("127.0.0.1", narrow_port)}
    with caplog.at_level(logging.WARNING):
        warn_open_engine_ports(opened)
    (record,) = caplog.records
    assert f"0.0.0.0:{wide_port}" in record.getMessage()
    assert str(narrow_port) not in record.getMessage()
