"""The registered arena end to end: HTTP, the real encoder, real Mooncake engines over TCP.

With the arena, the server registers one region at start and no request registers anything:
each image's row is written into an arena segment by the forward, a request's embedding is
its images' segments, and each rank's buffer receives them back to back from one batched
call. Every byte that lands is checked against the model run directly, and the registration
counts come from ``/metrics``, as an operator would read them.
"""

from __future__ import annotations

from dataclasses import replace

from support.engines import RankEngines
from support.harness import serve_small_model_to_every_rank
from support.models import SMALL, SMALL_ROW
from trio_encode.client import metric_value
from trio_encode.encoder import ImageEncoder
from trio_encode.testing.images import noise_uri


async def test_tp4_over_the_arena_registers_once_for_all_requests(
    rank_engines: RankEngines,
) -> None:
    """Six requests of two images (one image shared by every request: a cache hit after the
    first), four ranks each: one registration in all, and every rank gets the right bytes."""
    encoder = ImageEncoder.from_settings(replace(SMALL, arena_bytes=4 << 20))
    shared = noise_uri(900)
    requests = {f"arena-{i}": [noise_uri(300 + i), shared] for i in range(6)}
    text = await serve_small_model_to_every_rank(rank_engines, encoder, requests)
    assert metric_value(text, "arena_registrations") == 1, "the arena, once, held"
    assert metric_value(text, "registrations_total") == 0, "no request registered anything"
    assert metric_value(text, "deregistrations_total") == 0
    assert metric_value(text, "arena_fallbacks") == 0
    assert metric_value(text, "arena_leased_bytes") == 0, "every scope gave its segments back"
    assert metric_value(text, "arena_cached_bytes") == 7 * 4096 * 4  # 7 images, 16 KiB each
    assert metric_value(text, "register_seconds_count") == 1
    assert metric_value(text, "engine_errors_total") == 0


async def test_a_full_arena_falls_back_to_per_request_registration(
    rank_engines: RankEngines,
) -> None:
    """An arena with room for one image: two-image requests do not fit, so each registers its
    own embedding (counted as a fallback) and is served all the same, byte for byte."""
    encoder = ImageEncoder.from_settings(replace(SMALL, arena_bytes=SMALL_ROW, cache_bytes=0))
    requests = {f"full-{i}": [noise_uri(500 + 2 * i), noise_uri(501 + 2 * i)] for i in range(3)}
    text = await serve_small_model_to_every_rank(rank_engines, encoder, requests)
    fallbacks = metric_value(text, "arena_fallbacks")
    assert fallbacks == len(requests)
    # Each fallback's rows that lie outside the arena (sent as they lie, never concatenated):
    # one or both of its two images.
    registered = metric_value(text, "registrations_total")
    assert fallbacks <= registered <= 2 * fallbacks
    assert metric_value(text, "deregistrations_total") == registered
    assert metric_value(text, "arena_registrations") == 1
    assert metric_value(text, "arena_leased_bytes") == 0
