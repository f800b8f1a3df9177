"""The encoder with the real built-in model in real worker threads (real clock, tiny model)."""

from __future__ import annotations

from dataclasses import replace

import torch
import trio

from support.models import fixed
from trio_encode.embedding import Embedding
from trio_encode.encoder import EncoderSettings, ImageEncoder, Preprocess, load_backend
from trio_encode.testing.images import noise_png

TINY = EncoderSettings(
    image_size=32,
    patch_size=8,
    width=32,
    depth=2,
    heads=2,
    hidden_size=64,
    max_batch_size=4,
    max_batch_wait=0.5,
    cache_bytes=0,
)


class Counting:
    """Wraps a backend and records each forward's batch size."""

    def __init__(self, settings: EncoderSettings) -> None:
        self.inner = fixed(load_backend(settings))
        self.model_id: str = self.inner.model_id
        self.preprocess: Preprocess = self.inner.preprocess
        self.tokens_per_image: int = self.inner.tokens_per_image
        self.hidden_size: int = self.inner.hidden_size
        self.dtype: torch.dtype = self.inner.dtype
        self.batches: list[int] = []

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.batches.append(int(pixels.shape[0]))
        return self.inner.forward(pixels)


async def encode_together(encoder: ImageEncoder, requests: list[list[bytes]]) -> list[Embedding]:
    results: list[Embedding | None] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await encoder.encode(requests[i])

    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        async with trio.open_nursery() as callers:
            for i in range(len(requests)):
                callers.start_soon(one, i)
        nursery.cancel_scope.cancel()
    return [r for r in results if r is not None]


async def test_concurrent_requests_fuse_into_one_forward() -> None:
    backend = Counting(TINY)
    encoder = ImageEncoder(backend, TINY)
    results = await encode_together(encoder, [[noise_png(i)] for i in range(4)])
    assert backend.batches == [1, 4]  # the warm-up, then one batch for all four
    assert all((e.rows, e.dim) == (16, 64) for e in results)


async def test_same_image_same_bytes_in_any_batch_position_size_and_encoder() -> None:
    target = noise_png(99)
    alone = await encode_together(ImageEncoder(Counting(TINY), TINY), [[target]])
    for position in (0, 2):
        others = [[noise_png(i)] for i in range(3)]
        others.insert(position, [target])
        backend = Counting(TINY)
        fused = await encode_together(ImageEncoder(backend, TINY), others)
        assert backend.batches == [1, 4]
        assert torch.equal(fused[position].tensor, alone[0].tensor)
    pair = await encode_together(ImageEncoder(Counting(TINY), TINY), [[noise_png(5), target]])
    assert torch.equal(pair[0].tensor[16:], alone[0].tensor)


async def test_cache_hit_returns_the_same_memory_and_skips_the_forward() -> None:
    settings = replace(TINY, cache_bytes=1 << 20, max_batch_wait=0.0)
    backend = Counting(settings)
    encoder = ImageEncoder(backend, settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        first = await encoder.encode([noise_png(1)])
        second = await encoder.encode([noise_png(1)])
        nursery.cancel_scope.cancel()
    assert backend.batches == [1, 1]
    assert second.address == first.address
    assert second.tensor is first.tensor
    assert encoder.cache is not None
    assert encoder.cache.nbytes == first.nbytes


async def test_multi_image_rows_are_concatenated_in_order() -> None:
    single = await encode_together(
        ImageEncoder(Counting(TINY), TINY),
        [[noise_png(1)], [noise_png(2)], [noise_png(3)]],
    )
    (multi,) = await encode_together(
        ImageEncoder(Counting(TINY), TINY),
        [[noise_png(1), noise_png(2), noise_png(3)]],
    )
    assert multi.rows == 48
    assert torch.equal(multi.tensor, torch.cat([e.tensor for e in single]))


async def test_bfloat16_encoder_end_to_end() -> None:
    settings = replace(TINY, dtype="bfloat16")
    encoder = ImageEncoder(Counting(settings), settings)
    (embedding,) = await encode_together(encoder, [[noise_png(1)]])
    assert embedding.dtype == "bfloat16"
    assert encoder.info.dtype == "bfloat16"
    assert embedding.nbytes == 16 * 64 * 2
    assert torch.isfinite(embedding.tensor.float()).all()
