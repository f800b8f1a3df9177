"""Request scopes over arena segments, on the in-memory engine and Trio's mock clock.

The arena is registered once; a request whose embedding lies in it registers nothing, sends
its segments back to back in one call, and gives its segment leases back only after every
transfer reading them has returned (the segment could otherwise be reused, or evicted, and
overwritten under a transfer).
"""

from __future__ import annotations

import torch
import trio
import trio.testing

from support.arena_rig import SEGMENT, arena_rig, fill, opener
from support.lifecycle_rig import gather_sends
from trio_encode.arena import Segment
from trio_encode.embedding import ArenaEmbedding
from trio_encode.request_types import SendReport


def expected_bytes(parts: list[tuple[Segment, torch.Tensor]]) -> bytes:
    return b"".join(bytes(segment.buffer) for segment, _ in parts)


async def test_a_request_in_the_arena_registers_nothing_and_lands_every_byte(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three requests of two images each, four ranks each: one registration in all (the
    arena's), every rank's buffer holds the two segments back to back."""
    async with arena_rig(transfer_latency=0.01) as (rig, arena, _):
        ranks = await rig.landings(4, nbytes=2 * SEGMENT)
        for request in range(3):
            parts = [fill(arena, 10 * request + 1), fill(arena, 10 * request + 2)]
            expected = expected_bytes(parts)
            await rig.open(f"r{request}", opener(ArenaEmbedding(parts)), receive_count=4)
            results = await gather_sends(rig, f"r{request}", [r.receiver for r in ranks])
            assert all(isinstance(r, SendReport) for r in results), results
            for rank in ranks:
                assert rank.landed(2 * SEGMENT) == expected
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sender.count("register") == 1, "only the arena was ever registered"
        assert rig.sender.count("deregister") == 0
        assert arena.leased_bytes == 0, "every scope gave its segments back"
        assert rig.fabric.violations == []


async def test_segments_go_back_only_after_the_transfer_reading_them_returned(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The scope is cut short (shutdown) while its transfer runs in a "thread": the segment
    stays leased until the transfer has returned, so it cannot be handed out again and
    overwritten under it."""
    async with arena_rig() as (rig, arena, _):
        parts = [fill(arena, 1)]
        expected = expected_bytes(parts)
        await rig.open("r1", opener(ArenaEmbedding(parts)), receive_count=2)
        a, _b = await rig.landings(2)
        gate = rig.sender.gate("transfer")
        scope = rig.registry.require_live("r1")
        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(gather_sends, rig, "r1", [a.receiver])
                await gate.wait_arrivals(1)
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert arena.leased_bytes == SEGMENT, "released under a running transfer"
                assert arena.allocate(arena.nbytes) is None
            finally:
                gate.open()
        await scope.wait_ended()
        assert a.landed(SEGMENT) == expected
        assert arena.leased_bytes == 0
        assert arena.allocate(arena.nbytes) is not None
        assert rig.fabric.violations == []


async def test_a_cached_segment_shared_by_two_requests_stays_until_both_are_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 1 for the arena: a cache hit hands the same segment to a second request. It
    is leased twice, registered never, and the first request's end leaves it alone."""
    async with arena_rig() as (rig, arena, _):
        segment, view = fill(arena, 5)
        arena.keep(segment, "photo")
        arena.lease(segment)  # the second request's lease (a lookup)
        expected = bytes(segment.buffer)
        await rig.open("a", opener(ArenaEmbedding([(segment, view)])))
        await rig.open("b", opener(ArenaEmbedding([(segment, view)])))
        ra, rb = await rig.landings(2)
        await gather_sends(rig, "a", [ra.receiver])
        await trio.testing.wait_all_tasks_blocked()
        assert segment.leases == 1
        assert not segment.freed
        # Pressure on the arena cannot evict it while b leases it.
        while arena.allocate(SEGMENT) is not None:
            pass
        assert arena.lookup("photo") is segment
        arena.release(segment)
        await gather_sends(rig, "b", [rb.receiver])
        await trio.testing.wait_all_tasks_blocked()
        assert ra.landed(SEGMENT) == rb.landed(SEGMENT) == expected
        assert rig.sender.count("register") == 1
        assert segment.leases == 0


async def test_an_embedding_outside_the_arena_still_registers_once_per_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The fallback: an embedding in ordinary memory is registered by its scope, once for
    all its siblings, and deregistered when the scope ends; the arena stays registered."""
    async with arena_rig() as (rig, _arena, lease):
        encode, _ = rig.encoder("r1", seed=3)
        await rig.open("r1", encode, receive_count=2)
        ranks = await rig.landings(2)
        await gather_sends(rig, "r1", [r.receiver for r in ranks])
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sender.count("register") == 2  # the arena, then the request
        assert rig.sender.count("deregister") == 1
        for rank in ranks:
            assert rank.landed(SEGMENT) == rig.expected["r1"]
        await rig.ledger.release(lease)
        await rig.assert_nothing_held()
