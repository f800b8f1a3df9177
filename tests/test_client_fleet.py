"""The fleet client against real in-process servers and real receivers: failover, splits,
and an encoder list read from a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import trio

from support.engines import RankEngines
from support.harness import landing_pools, serving
from trio_encode.client import EncodeResult, LandingPool
from trio_encode.client.fleet import EncoderList, FleetClient, NoEncoderAvailable
from trio_encode.client.health import HealthTracker
from trio_encode.client.ranking import content_digest, rank
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
        serving(rank_engines.server) as harness,
        landing_pools(rank_engines, 2 * embedding_size(1)) as pools,
    ):
        encoders = [DEAD, harness.running.url]
        item = _item_ranking_first(DEAD, encoders)
        expected = expected_embedding([item_bytes(item)]).view(torch.uint8).flatten()
        async with FleetClient.open(encoders) as client:
            for attempt in range(2):
                slot = pools[attempt].allocate(embedding_size(1))
                result = await client.encode_and_send(
                    f"f{attempt}",
                    [item],
                    session_id=pools[attempt].session_id,
                    allocate=lambda _answer, slot=slot: slot.address,
                    receive_count=1,
                )
                assert result.encoder == harness.running.url
                assert torch.equal(_landed(pools[attempt], result.encoded, slot.address), expected)
                # The first request found the dead encoder; the second skipped it (down).
                assert result.failovers == (1 if attempt == 0 else 0)
            assert client.health.down() == [DEAD]
            assert client.stats.failovers == 1
        await harness.settled()


async def test_no_encoder_up_is_a_clear_error() -> None:
    async with FleetClient([DEAD, "http://127.0.0.1:2"]) as client:
        with pytest.raises(NoEncoderAvailable, match="all 2 encoders failed"):
            await client.encode_and_send(
                "n", [image_uri(b"x")], session_id="127.0.0.1:3", allocate=lambda _: 0
            )


async def test_a_forced_split_lands_correct_bytes_everywhere_and_is_counted(
    rank_engines: RankEngines,
) -> None:
    async with (
        serving(rank_engines.server, send_timeout=1.0) as first,
        serving(rank_engines.server, send_timeout=1.0) as second,
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
            slot = pools[r].allocate(embedding_size(1))
            results[r] = (
                slot,
                await clients[r].encode_and_send(
                    "split",
                    [item],
                    session_id=pools[r].session_id,
                    allocate=lambda _answer: slot.address,
                    receive_count=4,
                ),
            )

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
