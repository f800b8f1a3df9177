"""End to end over HTTP: TP ranks with real Mooncake engines, every landed byte checked."""

from __future__ import annotations

import pytest
import torch
import trio

from support.engines import TP, RankEngines
from support.harness import http_server, landing_pools
from trio_encode.client import ChecksumMismatch, LandingSlot, metric_value
from trio_encode.errors import RequestReleased
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import embedding_size, expected_embedding

REQUESTS = 12
IMAGES = 2


def _images(req: int) -> list[bytes]:
    return [f"image {req}.{i}".encode() * 50 for i in range(IMAGES)]


async def test_tp4_ranks_encode_and_send_many_requests_at_once(rank_engines: RankEngines) -> None:
    size = embedding_size(IMAGES)
    landed: dict[tuple[int, int], tuple[LandingSlot, int]] = {}
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, REQUESTS * size + 4096) as pools,
    ):

        async def rank(req: int, r: int) -> None:
            req_id = f"e2e-{req}"
            items = [image_uri(image) for image in _images(req)]
            encoded = await harness.client.encode(req_id, items, receive_count=TP, part_idx=r)
            assert encoded.embedding_size == size
            assert encoded.body["part_idx"] == r
            slot = pools[r].allocate(encoded.embedding_size)
            sent = await harness.client.send(req_id, pools[r].session_id, slot.address)
            assert (sent.embedding_len, sent.embedding_dim, sent.dtype) == (
                encoded.embedding_len,
                encoded.embedding_dim,
                "float32",
            )
            assert 1 <= sent.receivers_done <= TP
            assert sent.checksum == encoded.checksum
            slot.verify(sent.embedding_size, sent.checksum)
            landed[req, r] = (slot, sent.embedding_len)

        async with trio.open_nursery() as nursery:
            for req in range(REQUESTS):
                for r in range(TP):
                    nursery.start_soon(rank, req, r)

        for req in range(REQUESTS):
            expected = expected_embedding(_images(req))
            copies = [landed[req, r][0].read(*expected.shape, "float32") for r in range(TP)]
            for copy in copies:
                assert torch.equal(copy, expected)

        text = await harness.settled()
        assert metric_value(text, "registrations_total") == REQUESTS
        assert metric_value(text, "deregistrations_total") == REQUESTS
        assert metric_value(text, "transfer_bytes_total") == REQUESTS * TP * size
        assert metric_value(text, "requests_total", route="/send", status="200") == (REQUESTS * TP)
        assert metric_value(text, "backstop_expiries_total") == 0
        assert harness.encoder.runs == REQUESTS  # type: ignore[attr-defined]


async def test_a_rank_whose_answer_was_lost_gets_it_again_after_completion(
    rank_engines: RankEngines,
) -> None:
    """The request completed; one rank never saw its 200 and retries: 200 again, marked as a
    repeat. A rank that was never served is told 410, and a corrupted copy fails to verify."""
    size = embedding_size(1)
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 2 * size + 4096) as pools,
    ):
        item = [image_uri(b"lost answer")]
        encoded = await harness.client.encode("lost", item, receive_count=1)
        slot = pools[0].allocate(size)
        first = await harness.client.send("lost", pools[0].session_id, slot.address)
        await harness.settled()
        again = await harness.client.send("lost", pools[0].session_id, slot.address)
        assert (first.repeat, again.repeat) == (False, True)
        assert again.checksum == first.checksum == encoded.checksum
        assert metric_value(await harness.metrics(), "transfer_bytes_total") == size
        other = pools[1].allocate(size)
        with pytest.raises(RequestReleased):
            await harness.client.send("lost", pools[1].session_id, other.address)
        slot.verify(size, again.checksum)
        slot.raw()[0] ^= 0xFF
        with pytest.raises(ChecksumMismatch):
            slot.verify(size, again.checksum)
