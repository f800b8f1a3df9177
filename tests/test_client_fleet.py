"""The fleet client against real in-process servers and real receivers: failover, splits,
and an encoder list read from a file."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import torch
import trio

from support.engines import DelayedTransferEngine, RankEngines
from support.harness import http_server, landing_pools
from trio_encode.client import EncodeResult, LandingPool, PoolExhausted
from trio_encode.client.fleet import EncoderList, FleetClient, NoEncoderAvailable
from trio_encode.client.health import HealthTracker
from trio_encode.client.ranking import content_digest, rank
from trio_encode.errors import EngineFailed
from trio_encode.testing.faults import FaultPlan, FaultyEngine
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import embedding_size, expected_embedding

DEAD = "http://127.0.0.1:1"  # nothing listens on port 1


def _item_ranking_first(encoder: str, encoders: list[str]) -> str:
    """An image whose ranking puts ``encoder`` first."""
    for n in range(1000):
        item = image_uri(f"fleet image {n}")
        if rank(encoders, content_digest([item]))[0] == encoder:
            return item
    raise AssertionError("no such image")


def _landed(pool: LandingPool, answer: EncodeResult, address: int) -> torch.Tensor:
    offset = address - pool.address
    return pool.tensor[offset : offset + answer.embedding_size]


async def test_a_dead_encoder_is_failed_over_then_skipped(rank_engines: RankEngines) -> None:
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 2 * embedding_size(1)) as pools,
    ):
        encoders = [DEAD, harness.running.url]
        item = _item_ranking_first(DEAD, encoders)
        expected = expected_embedding([item_bytes(item)]).view(torch.uint8).flatten()
        async with FleetClient.open(encoders) as client:
            for attempt in range(2):
                result = await client.encode_and_send(
                    f"f{attempt}", [item], pool=pools[attempt], receive_count=1
                )
                assert result.encoder == harness.running.url
                landed = _landed(pools[attempt], result.encoded, result.slot.address)
                assert torch.equal(landed, expected)
                # The dead encoder failed its /encode: no /send named a slot, none quarantined.
                assert pools[attempt].quarantined_bytes == 0
                # The first request found the dead encoder; the second skipped it (down).
                assert result.failovers == (1 if attempt == 0 else 0)
            assert client.health.down() == [DEAD]
            assert client.stats.failovers == 1
        await harness.settled()


async def test_no_encoder_up_is_a_clear_error(rank_engines: RankEngines) -> None:
    async with (
        FleetClient([DEAD, "http://127.0.0.1:2"]) as client,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        with pytest.raises(NoEncoderAvailable, match="all 2 encoders failed"):
            await client.encode_and_send("n", [image_uri(b"x")], pool=pools[0])
        assert pools[0].free_bytes == pools[0].nbytes


async def test_a_forced_split_lands_correct_bytes_everywhere_and_is_counted(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(rank_engines.server, send_timeout=1.0) as first,
        http_server(rank_engines.server, send_timeout=1.0) as second,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        encoders = [first.running.url, second.running.url]
        item = _item_ranking_first(first.running.url, encoders)
        expected = expected_embedding([item_bytes(item)]).view(torch.uint8).flatten()
        # Ranks 0 and 1 believe every encoder is up; ranks 2 and 3 believe the first is down.
        disagree = HealthTracker(down_seconds=30)
        disagree.mark_down(first.running.url)
        clients = [FleetClient(encoders) for _ in range(2)] + [
            FleetClient(encoders, health=disagree) for _ in range(2)
        ]
        results = {}

        async def rank_request(r: int) -> None:
            result = await clients[r].encode_and_send(
                "split", [item], pool=pools[r], receive_count=4
            )
            results[r] = (result.slot, result)

        async with trio.open_nursery() as nursery:
            for r in range(4):
                nursery.start_soon(rank_request, r)
        for client in clients:
            await client.aclose()
        assert [results[r][1].encoder for r in range(4)] == [encoders[0]] * 2 + [encoders[1]] * 2
        for r in range(4):
            slot, result = results[r]
            assert torch.equal(_landed(pools[r], result.encoded, slot.address), expected)
        # Each encoder's scope served 2 of 4 and is freed by its backstop, counted as a split.
        for harness in (first, second):
            await harness.settled(within=5.0)
            assert await harness.value("scopes_split_total") == 1
            assert await harness.value("scopes_closed_total", reason="expired") == 1


def test_the_encoder_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    listing = tmp_path / "encoders"
    listing.write_text("http://a:1/  # first\n\nhttp://b:1\nhttp://a:1\n")
    encoders = EncoderList(listing)
    assert encoders.current() == ["http://a:1", "http://b:1"]
    listing.write_text("http://c:1\n")
    os.utime(listing, ns=(1, 1))  # a new mtime even within the clock's resolution
    assert encoders.current() == ["http://c:1"]
    listing.write_text("# nothing\n")
    os.utime(listing, ns=(2, 2))
    assert encoders.current() == ["http://c:1"]  # an empty file keeps the last good list
    listing.unlink()
    assert encoders.current() == ["http://c:1"]
    with pytest.raises(ValueError, match="empty"):
        EncoderList([])


def item_bytes(item: str) -> bytes:
    import base64

    return base64.b64decode(item.partition(",")[2])


async def test_a_failover_lands_in_a_fresh_slot_while_the_first_encoder_still_writes(
    rank_engines: RankEngines,
) -> None:
    """Encoder A takes the /send and starts its transfer, but the rank's call times out, so it
    fails over to B. A's transfer lands later: in the slot the rank gave up (quarantined),
    never in the one B answered 200 for, which the rank has read and reused by then."""
    slow = DelayedTransferEngine(rank_engines.server, delay=3.0)
    async with (
        http_server(slow) as first,
        http_server(rank_engines.server) as second,
        landing_pools(rank_engines, 2 * embedding_size(1) + 64) as pools,
    ):
        encoders = [first.running.url, second.running.url]
        item = _item_ranking_first(first.running.url, encoders)
        expected = expected_embedding([item_bytes(item)]).view(torch.uint8).flatten()
        pool = pools[0]
        async with FleetClient(encoders, timeout=1.5) as client:
            result = await client.encode_and_send("late", [item], pool=pool, receive_count=1)
        assert (result.encoder, result.failovers) == (second.running.url, 1)
        slot, size = result.slot, result.encoded.embedding_size
        slot.verify(size, result.encoded.checksum)
        assert pool.quarantined_bytes == slot.nbytes, "the slot A may still write is kept"
        with pytest.raises(PoolExhausted):
            pool.allocate(size)  # and not handed out again
        slot.raw().zero_()  # the rank has used its bytes and reuses the buffer
        await first.settled(within=10.0)  # A's transfer has returned: its bytes landed
        assert not bool(slot.raw().any()), "A's late write landed after B's 200"
        first_slot = pool.tensor[: expected.numel()] if slot.offset else None
        assert first_slot is not None
        assert torch.equal(first_slot, expected), "A's bytes are in the quarantined slot"
        slot.release()
        await second.settled()


async def test_a_send_failing_with_the_requests_own_error_quarantines_its_slot(
    rank_engines: RankEngines,
) -> None:
    """The request's own error from /send (here the engine failed the transfer) is raised and
    leaves no slot allocated to the caller: the slot is quarantined, not released, since a
    transfer the server gave up on may still write into it."""
    failing = FaultyEngine(rank_engines.server, FaultPlan(transfer=1.0))
    async with (
        http_server(failing, send_timeout=1.0) as only,
        landing_pools(rank_engines, embedding_size(1)) as pools,
        FleetClient([only.running.url]) as client,
    ):
        pool = pools[0]
        with pytest.raises(EngineFailed):
            await client.encode_and_send("own", [image_uri(b"own")], pool=pool, receive_count=1)
        assert pool.quarantined_bytes == pool.nbytes
        assert pool.free_bytes == 0
        await only.settled()  # the scope waited for a retry until its backstop


@asynccontextmanager
async def _refusing_encoder(kind: str) -> AsyncIterator[str]:
    """An encoder that answers every request 503 with error ``kind`` (draining: shutting_down;
    at a capacity limit: overloaded), as the server's error body has it; its base URL."""
    body = json.dumps({"status": "error", "error": kind, "message": f"stand-in: {kind}"})
    answer = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: 1\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
    ).encode()
    asked: list[bytes] = []

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                head += chunk
            asked.append(head.split(b" ", 2)[1])
            await stream.send_all(answer)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()
    assert asked, "the refusing encoder was never asked"


@pytest.mark.parametrize("kind", ["shutting_down", "overloaded"])
async def test_a_503_from_the_first_encoder_fails_over_to_the_next(
    rank_engines: RankEngines, kind: str
) -> None:
    """The encoder ranked first answers /encode 503 (draining, or at a capacity limit): the
    request lands on the next encoder with the right bytes, one failover counted."""
    async with (
        _refusing_encoder(kind) as refusing,
        http_server(rank_engines.server) as healthy,
        landing_pools(rank_engines, embedding_size(1)) as pools,
    ):
        encoders = [refusing, healthy.running.url]
        item = _item_ranking_first(refusing, encoders)
        expected = expected_embedding([item_bytes(item)]).view(torch.uint8).flatten()
        async with FleetClient(encoders) as client:
            result = await client.encode_and_send(kind, [item], pool=pools[0], receive_count=1)
            assert (result.encoder, result.failovers) == (healthy.running.url, 1)
            assert client.stats.failovers == 1
            assert client.health.down() == [refusing]
        result.slot.verify(result.encoded.embedding_size, result.encoded.checksum)
        assert torch.equal(_landed(pools[0], result.encoded, result.slot.address), expected)
        assert pools[0].quarantined_bytes == 0  # the refusal came before any /send
        result.slot.release()
        await healthy.settled()
