"""A fake encoder rig for mock-clock tests: the fake backend's output row is the image's own
colour, and the "thread" runs inline after a virtual-time sleep, so no real thread meets the
mock clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import torch
import trio

from trio_encode.embedding import Embedding, RowsEmbedding
from trio_encode.encoder import EncoderSettings, ImageEncoder, Preprocess
from trio_encode.testing.images import solid_image

T = TypeVar("T")
FORWARD_SECONDS = 1.0
SETTINGS = EncoderSettings(
    max_batch_size=4, max_batch_wait=0.01, queue_size=8, cache_bytes=0, warmup=False
)


class FakeBackend:
    """Each image's embedding is its colour: row ``(r, g, b)`` in every token."""

    model_id = "fake"
    preprocess = Preprocess(image_size=4, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    tokens_per_image = 2
    hidden_size = 3
    dtype = torch.float32

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.fail = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        red = [round(float(v) * 255) for v in pixels[:, 0, 0, 0]]
        self.batches.append(red)
        if self.fail:
            raise RuntimeError("out of cheese")
        colour = pixels[:, :, 0, 0] * 255
        return colour.unsqueeze(1).expand(-1, 2, 3).round().contiguous()

    @property
    def encoded(self) -> list[int]:
        return [red for batch in self.batches for red in batch]


class Events:
    """An EncoderObserver that writes everything down."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, bool]] = []
        self.waits: list[float] = []
        self.lookups: list[tuple[int, int]] = []
        self.sizes: list[tuple[int, int]] = []
        self.rejections: list[int] = []

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.batches.append((images, ok))

    def queue_waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def cache_looked_up(self, hits: int, misses: int) -> None:
        self.lookups.append((hits, misses))

    def cache_size(self, nbytes: int, entries: int) -> None:
        self.sizes.append((nbytes, entries))

    def rejected(self, images: int) -> None:
        self.rejections.append(images)

    def cache_poisoned(self, images: int, source: str) -> None:
        raise AssertionError(f"{images} cached embeddings found poisoned")


async def inline(fn: Callable[[], T]) -> T:
    return fn()


class SlowForward:
    """Runs the forward inline after FORWARD_SECONDS of virtual time."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, fn: Callable[[], T]) -> T:
        self.calls += 1
        await trio.sleep(FORWARD_SECONDS)
        return fn()


def image(red: int) -> bytes:
    """A tiny image whose red value the fake backend's embedding shows."""
    return solid_image(4, 4, (red, 7, 9))


def reds(embedding: Embedding | RowsEmbedding) -> list[int]:
    return [int(v) for v in embedding.tensor[:, 0]]


def make(settings: EncoderSettings = SETTINGS) -> tuple[ImageEncoder, FakeBackend, Events]:
    backend = FakeBackend()
    events = Events()
    encoder = ImageEncoder(
        backend, settings, observer=events, run_decode=inline, run_forward=SlowForward()
    )
    return encoder, backend, events


@asynccontextmanager
async def encoder_running(encoder: ImageEncoder) -> AsyncIterator[trio.Nursery]:
    """``encoder`` running its batches for the body of the ``async with`` (no HTTP server);
    the nursery it runs in is yielded for the body's own tasks."""
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        yield nursery
        nursery.cancel_scope.cancel()


async def occupy_the_forward(encoder: ImageEncoder, nursery: trio.Nursery) -> None:
    """Start encoding image 1 in ``nursery`` and return once its batch is in the forward
    (from 0.01 s to 1.01 s under ``SETTINGS``): with one-image batches, what comes next queues."""
    nursery.start_soon(encoder.encode, [image(1)])
    await trio.sleep(0.1)


class Fingerprinted(FakeBackend):
    """A fake backend with a model fingerprint, so a cross-server store may key its output."""

    fingerprint = "fake-model"
