"""The keeper on the mock clock: every local hit, in the arena or in plain memory, is checked by
the one verification before it is served, and the arena's records do not outgrow it."""

from __future__ import annotations

from dataclasses import replace

import torch
import trio
import trio.testing

from support.fake_encoder import (
    SETTINGS,
    Events,
    FakeBackend,
    SlowForward,
    encoder_running,
    image,
    inline,
    reds,
)
from trio_encode.arena import Arena
from trio_encode.embedding import ArenaEmbedding
from trio_encode.encoder import ImageEncoder, content_key
from trio_encode.encoder.keeping import _InArena


class Poisoned(Events):
    """The fake encoder's observer, counting poisoned rows by source instead of failing."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned: dict[str, int] = {}

    def cache_poisoned(self, images: int, source: str) -> None:
        self.poisoned[source] = self.poisoned.get(source, 0) + images


def make(arena: Arena | None) -> tuple[ImageEncoder, FakeBackend, Poisoned]:
    backend, observer = FakeBackend(), Poisoned()
    encoder = ImageEncoder(
        backend,
        replace(SETTINGS, cache_bytes=1 << 20),
        observer=observer,
        run_decode=inline,
        run_forward=SlowForward(),
        arena=arena,
    )
    return encoder, backend, observer


async def test_an_overwritten_arena_segment_is_dropped_and_encoded_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    arena = Arena(1 << 20)
    encoder, backend, observer = make(arena)
    async with encoder_running(encoder):
        (await encoder.encode([image(30)])).release()
        (segment,) = arena._cached.values()
        segment.buffer[:] = b"\x07" * segment.nbytes  # a write through the engine's port
        again = await encoder.encode([image(30), image(30)])
        assert isinstance(again, ArenaEmbedding)
        assert reds(again) == [30, 30, 30, 30], "the written bytes were served"
        assert backend.encoded == [30, 30], "not encoded again"
        assert observer.poisoned == {"arena": 1}
        again.release()
        hit = await encoder.encode([image(30)])  # the new segment is intact: a hit
        assert backend.encoded == [30, 30]
        hit.release()
    assert arena.leased_bytes == 0


async def test_an_overwritten_cached_row_is_dropped_and_encoded_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, observer = make(None)
    async with encoder_running(encoder):
        await encoder.encode([image(40)])
        assert encoder.cache is not None
        row = encoder.cache.get(content_key(backend.model_id, image(40)))
        assert row is not None
        with torch.inference_mode():  # the forward made it
            row.fill_(13.0)  # a write while the row lay registered
        again = await encoder.encode([image(40)])
    assert reds(again) == [40, 40], "the written bytes were served"
    assert backend.encoded == [40, 40], "not encoded again"
    assert observer.poisoned == {"cache": 1}


async def test_the_arena_records_are_pruned_as_the_arena_evicts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The arena keeps one segment at a time here; the records of the segments it evicted go
    too, rather than one for every image ever seen."""
    arena = Arena(4096, cache_bytes=4096)
    encoder, _, _ = make(arena)
    local = encoder.keeper.local
    assert isinstance(local, _InArena)
    async with encoder_running(encoder):
        for red in range(40):
            (await encoder.encode([image(red)])).release()
    assert len(arena) == 1
    assert len(local._written) <= 2 * len(arena) + 16
