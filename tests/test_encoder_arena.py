"""The encoder over the registered arena, on Trio's mock clock: rows written into segments,
the arena as the cache, and a full arena waited on, then fallen back from, never a failure."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import trio
import trio.testing

from support.fake_encoder import (
    FORWARD_SECONDS,
    SETTINGS,
    Events,
    FakeBackend,
    SlowForward,
    encoder_running,
    image,
    inline,
)
from trio_encode.arena import Arena
from trio_encode.embedding import ArenaEmbedding, Embedding, RowsEmbedding
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder.keeping import ARENA_WAIT


def make(arena: Arena, cache_bytes: int = 0) -> ImageEncoder:
    settings = replace(SETTINGS, cache_bytes=cache_bytes)
    return ImageEncoder(
        FakeBackend(),
        settings,
        observer=Events(),
        run_decode=inline,
        run_forward=SlowForward(),
        arena=arena,
    )


def reds(embedding: Embedding | ArenaEmbedding | RowsEmbedding) -> list[int]:
    tensor = embedding.tensor
    return [int(v) for v in tensor[:, 0]]


async def test_rows_are_written_into_segments_of_the_arena(
    autojump_clock: trio.testing.MockClock,
) -> None:
    arena = Arena(1 << 20)
    encoder = make(arena)
    async with encoder_running(encoder):
        embedding = await encoder.encode([image(10), image(20), image(10)])
    assert isinstance(embedding, ArenaEmbedding)
    assert reds(embedding) == [10, 10, 20, 20, 10, 10]
    addresses = [address for address, _ in embedding.segments]
    assert all(arena.address <= a < arena.address + arena.nbytes for a in addresses)
    assert addresses[0] == addresses[2], "the same image, one segment"
    assert arena.leased_bytes > 0
    embedding.release()
    assert arena.leased_bytes == 0


async def test_the_arena_is_the_cache(autojump_clock: trio.testing.MockClock) -> None:
    arena = Arena(1 << 20)
    encoder = make(arena, cache_bytes=1 << 20)
    async with encoder_running(encoder):
        first = await encoder.encode([image(30)])
        first.release()
        started = trio.current_time()
        again = await encoder.encode([image(30)])
    assert trio.current_time() == started, "served from the arena, no forward"
    assert again.segments == first.segments
    assert reds(again) == [30, 30]


async def test_a_full_arena_is_waited_on_and_its_room_used(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Room for one image: the second request waits until the first releases its segment,
    then is served from the arena, with no fallback."""
    arena = Arena(4096, cache_bytes=0)
    encoder = make(arena)
    async with encoder_running(encoder):
        held = await encoder.encode([image(1)])
        result: list[Embedding | ArenaEmbedding] = []

        async def second() -> None:
            result.append(await encoder.encode([image(2)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await trio.sleep(ARENA_WAIT / 2)
            assert not result, "it waits while the arena is full"
            held.release()
    (embedding,) = result
    assert isinstance(embedding, ArenaEmbedding)
    assert reds(embedding) == [2, 2]
    assert arena.fallbacks == 0


async def test_a_full_arena_falls_back_to_ordinary_memory_after_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nobody releases: after ARENA_WAIT the image is encoded into ordinary memory, the
    request is served (it will register its own embedding) and the fallback is counted."""
    arena = Arena(4096, cache_bytes=0)
    encoder = make(arena)
    async with encoder_running(encoder):
        held = await encoder.encode([image(1)])
        started = trio.current_time()
        embedding = await encoder.encode([image(2)])
        elapsed = trio.current_time() - started
    assert isinstance(embedding, Embedding)
    assert reds(embedding) == [2, 2]
    assert arena.fallbacks == 1
    assert elapsed == pytest.approx(ARENA_WAIT + FORWARD_SECONDS, abs=0.05)
    held.release()
    assert arena.leased_bytes == 0


class WideBackend(FakeBackend):
    """The fake model with 1000-float rows: 8 kB per image, more than a one-page arena."""

    hidden_size = 1000

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        narrow = super().forward(pixels)
        return narrow[:, :, :1].expand(-1, -1, 1000).contiguous()


async def test_an_arena_too_small_for_any_image_is_not_waited_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A misconfigured arena smaller than one embedding: requests fall back at once."""
    arena = Arena(16, cache_bytes=0)  # rounded up to one 4 kB page
    encoder = ImageEncoder(
        WideBackend(),
        replace(SETTINGS, cache_bytes=0),
        run_decode=inline,
        run_forward=SlowForward(),
        arena=arena,
    )
    async with encoder_running(encoder):
        started = trio.current_time()
        embedding = await encoder.encode([image(5)])
        elapsed = trio.current_time() - started
    assert isinstance(embedding, Embedding)
    assert reds(embedding) == [5, 5]
    assert elapsed == pytest.approx(FORWARD_SECONDS, abs=0.05), "no wait for room"
    assert arena.fallbacks == 1


async def test_a_request_cancelled_while_waiting_for_room_leaves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    arena = Arena(2 * 4096, cache_bytes=0)
    encoder = make(arena)
    async with encoder_running(encoder):
        held = await encoder.encode([image(1)])
        with trio.move_on_after(ARENA_WAIT / 4):
            await encoder.encode([image(2), image(3)])  # one segment free, one to wait for
        assert arena.leased_bytes == 4096, "only the first request's segment is held"
        assert encoder.queued_images == 0
        held.release()
    assert arena.leased_bytes == 0
    assert arena.free_bytes == arena.nbytes


async def test_a_row_sent_as_it_lies_in_the_arena_keeps_its_segment_until_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request whose images did not all fit is sent as its rows lie, one of them in an arena
    segment: the embedding holds that segment's lease until it is released (after every
    transfer), so the arena cannot evict it and write another image there meanwhile."""
    arena = Arena(4096, cache_bytes=4096)  # one segment, which may be cached
    encoder = make(arena, cache_bytes=4096)
    async with encoder_running(encoder):
        mixed = await encoder.encode([image(1), image(2)])  # one in the arena, one outside
        assert isinstance(mixed, RowsEmbedding)
        assert arena.leased_bytes == 4096
        other = await encoder.encode([image(3)])  # needs the one segment
        assert reds(mixed) == [1, 1, 2, 2], "another image was written into the segment"
        other.release()
        mixed.release()
    assert arena.leased_bytes == 0
