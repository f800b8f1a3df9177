"""Batching images of different sizes: a forward is bounded by a token budget as well as an
image count, images of different token counts share one forward, and each image gets exactly
its own rows back (in the arena too, where segments of different sizes sit side by side).

The model is a fake whose image of width ``w`` has ``w`` tokens, every row holding the image's
red value and the row's index, so a misplaced or mis-split row shows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TypeVar

import torch
import trio
import trio.testing

from trio_encode.arena import Arena
from trio_encode.embedding import ArenaEmbedding, Embedding
from trio_encode.encoder import EncoderSettings, ImageEncoder, Prepared
from trio_encode.encoder.images import open_image
from trio_encode.testing.images import solid_image

T = TypeVar("T")
SETTINGS = EncoderSettings(
    max_batch_size=8, max_batch_wait=0.01, queue_size=16, cache_bytes=0, warmup=False
)


class SizedModel:
    """An image ``w`` pixels wide has ``w`` tokens; row ``i`` is ``(red, i)``."""

    model_id = "sized"
    fingerprint = "sized"
    hidden_size = 2
    dtype = torch.float32
    device = torch.device("cpu")
    fixed_tokens = None

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.started: list[float] = []

    def decode(self, data: bytes, *, max_pixels: int) -> Prepared:
        image = open_image(data, max_pixels=max_pixels)
        red = float(image.getpixel((0, 0))[0])  # type: ignore[index]
        return Prepared(torch.tensor([red]), image.width, (1, 1, image.width))

    def encode(self, images: Sequence[Prepared]) -> list[torch.Tensor]:
        self.batches.append([image.tokens for image in images])
        self.started.append(trio.current_time())
        return [
            torch.stack(
                [
                    image.pixels.expand(image.tokens),
                    torch.arange(image.tokens, dtype=torch.float32),
                ],
                dim=1,
            )
            for image in images
        ]


async def inline(fn: Callable[[], T]) -> T:
    await trio.sleep(1.0)
    return fn()


def picture(red: int, width: int) -> bytes:
    return solid_image(width, 3, (red, 0, 0))


@asynccontextmanager
async def serving(
    settings: EncoderSettings, arena: Arena | None = None
) -> AsyncIterator[tuple[ImageEncoder, SizedModel]]:
    model = SizedModel()
    encoder = ImageEncoder(model, settings, run_decode=inline, run_forward=inline, arena=arena)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        yield encoder, model
        nursery.cancel_scope.cancel()


def check_rows(embedding: Embedding | ArenaEmbedding, images: list[tuple[int, int]]) -> None:
    """Each image's rows are its own, in order: ``(red, 0..width-1)``."""
    expected = torch.cat(
        [
            torch.stack([torch.full((w,), float(r)), torch.arange(w, dtype=torch.float32)], 1)
            for r, w in images
        ]
    )
    assert torch.equal(embedding.tensor, expected)
    assert list(embedding.image_lens) == [w for _, w in images]
    assert list(embedding.grids) == [(1, 1, w) for _, w in images]


async def test_a_forward_holds_at_most_max_batch_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    images = [(10, 5), (20, 7), (30, 3), (40, 9), (50, 2)]
    async with serving(replace(SETTINGS, max_batch_tokens=12)) as (encoder, model):
        embedding = await encoder.encode([picture(r, w) for r, w in images])
    assert model.batches == [[5, 7], [3, 9], [2]]
    assert all(sum(batch) <= 12 for batch in model.batches)
    check_rows(embedding, images)


async def test_an_image_over_the_budget_runs_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    images = [(10, 20), (20, 4)]
    async with serving(replace(SETTINGS, max_batch_tokens=8)) as (encoder, model):
        embedding = await encoder.encode([picture(r, w) for r, w in images])
    assert model.batches == [[20], [4]]
    check_rows(embedding, images)


async def test_without_a_budget_sizes_are_mixed_in_one_forward(
    autojump_clock: trio.testing.MockClock,
) -> None:
    images = [(10, 5), (20, 17), (30, 1)]
    async with serving(SETTINGS) as (encoder, model):
        embedding = await encoder.encode([picture(r, w) for r, w in images])
    assert model.batches == [[5, 17, 1]]
    check_rows(embedding, images)


async def test_a_full_budget_starts_the_forward_without_waiting_out_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = replace(SETTINGS, max_batch_tokens=10, max_batch_wait=100.0)
    async with serving(settings) as (encoder, model):
        await encoder.encode([picture(1, 6), picture(2, 6)])
    assert model.batches == [[6], [6]]
    # The first forward ran as soon as the queue held a budget's worth (after the decode and
    # the forward's second of virtual time); the last image alone waited out its window.
    assert model.started[0] < 5.0
    assert model.started[1] >= 100.0


async def test_images_of_different_sizes_share_the_arena_unpadded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    images = [(10, 5), (20, 300), (30, 1)]
    arena = Arena(1 << 20)
    async with serving(SETTINGS, arena=arena) as (encoder, _):
        embedding = await encoder.encode([picture(r, w) for r, w in images])
        assert isinstance(embedding, ArenaEmbedding)
        assert [nbytes for _, nbytes in embedding.segments] == [w * 2 * 4 for _, w in images]
        check_rows(embedding, images)
        embedding.release()
        # A repeat is served from the arena's cache with the same rows and grids.
        again = await encoder.encode([picture(r, w) for r, w in images])
        assert isinstance(again, ArenaEmbedding)
        check_rows(again, images)
        again.release()
