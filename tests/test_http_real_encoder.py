"""End to end over HTTP with the real encoder (a small built-in ViT) and real Mooncake engines.

The server batches concurrent /encode calls into one forward and serves repeated images from
its cache; both make requests share embedding memory. These tests check, over the real engine
(which answers a second registration of the same bytes with -7), that every byte lands right
and that shared memory is registered once.
"""

from __future__ import annotations

import torch
import trio

from support.engines import RankEngines
from support.harness import http_server, landing_pools, serve_small_model_to_every_rank
from support.models import SMALL, SMALL_ROW, direct
from trio_encode.client import metric_value
from trio_encode.encoder import ImageEncoder
from trio_encode.testing.images import noise_uri


async def test_tp4_ranks_with_the_real_encoder_every_byte_checked(
    rank_engines: RankEngines,
) -> None:
    encoder = ImageEncoder.from_settings(SMALL)
    requests = {f"vit-{i}": [noise_uri(100 + 2 * i), noise_uri(101 + 2 * i)] for i in range(6)}
    text = await serve_small_model_to_every_rank(rank_engines, encoder, requests)
    # Each image's row is sent as it lies (never concatenated), so registered on its own.
    assert metric_value(text, "registrations_total") == 2 * len(requests)
    assert metric_value(text, "engine_errors_total") == 0


async def test_cache_hit_across_requests_registers_the_shared_memory_once(
    rank_engines: RankEngines,
) -> None:
    """Invariant 1 over the real engine: request b is a cache hit on request a's image, so
    both embeddings are one tensor. While a is still live (one of its two ranks has sent), b
    leases a's registration instead of registering the same bytes again."""
    encoder = ImageEncoder.from_settings(SMALL)
    uri = noise_uri(7)
    size = SMALL_ROW
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, 4 * size) as pools,
    ):
        slots = [pool.allocate(size) for pool in pools]
        with trio.fail_after(60):
            await harness.client.encode("a", [uri], receive_count=2)
            await harness.client.send("a", pools[0].session_id, slots[0].address)
            assert await harness.value("live_registrations") == 1  # a holds it, waiting
            await harness.client.encode("b", [uri], receive_count=2)
            await harness.client.send("b", pools[1].session_id, slots[1].address)
            await harness.client.send("b", pools[2].session_id, slots[2].address)
            await harness.client.send("a", pools[3].session_id, slots[3].address)
            text = await harness.settled()

        expected = direct(encoder, [uri])
        for slot in slots:
            assert torch.equal(slot.read(*expected.shape, "float32"), expected)
        assert metric_value(text, "registrations_total") == 1
        assert metric_value(text, "deregistrations_total") == 1
        assert encoder.cache is not None
        assert len(encoder.cache) == 1  # b was served from the cache: one image encoded
