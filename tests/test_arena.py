"""The arena's own promises: segments never overlap, a leased segment is never reused or
evicted, the cache keeps what it may and evicts least recently used first, and a full arena
says so (so the caller can fall back) instead of failing."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import trio
import trio.testing

from trio_encode.arena import ALIGN, Arena, Segment

MB = 1 << 20


def spans(segments: list[Segment]) -> list[tuple[int, int]]:
    return sorted((s.address, s.address + s.nbytes) for s in segments)


def test_segments_are_aligned_disjoint_and_inside_the_arena() -> None:
    arena = Arena(4 * MB)
    segments = [arena.allocate(size) for size in (1, 5000, MB, 3 * ALIGN, 100)]
    assert all(s is not None for s in segments)
    live = [s for s in segments if s is not None]
    for segment in live:
        assert segment.address % ALIGN == 0
        assert arena.address <= segment.address
        assert segment.address + segment.nbytes <= arena.address + arena.nbytes
    ordered = spans(live)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ordered))


def test_the_bytes_written_through_a_segment_are_at_its_address() -> None:
    arena = Arena(MB)
    segment = arena.allocate(16)
    assert segment is not None
    segment.buffer[:] = bytes(range(16))
    assert ctypes.string_at(segment.address, 16) == bytes(range(16))


def test_a_full_arena_answers_none_and_room_comes_back_on_release() -> None:
    arena = Arena(2 * MB)
    first, second = arena.allocate(MB), arena.allocate(MB)
    assert first is not None
    assert second is not None
    assert arena.allocate(1) is None, "full: the caller must fall back"
    arena.release(first)
    again = arena.allocate(MB)
    assert again is not None
    assert again.address == first.address


def test_freed_neighbours_merge_so_a_large_segment_fits_again() -> None:
    arena = Arena(4 * MB)
    parts = [arena.allocate(MB) for _ in range(4)]
    for part in parts:
        assert part is not None
        arena.release(part)
    assert arena.free_bytes == arena.nbytes
    assert arena.allocate(4 * MB) is not None


def test_a_leased_segment_is_not_reused_until_its_last_lease_ends() -> None:
    arena = Arena(MB)
    segment = arena.allocate(MB)
    assert segment is not None
    arena.lease(segment)  # a second holder (a sibling request)
    arena.release(segment)
    assert arena.allocate(1) is None
    assert arena.leased_bytes == MB
    arena.release(segment)
    assert arena.leased_bytes == 0
    assert arena.allocate(MB) is not None


def test_releasing_more_often_than_leased_is_a_bug_that_is_caught() -> None:
    arena = Arena(MB)
    segment = arena.allocate(10)
    assert segment is not None
    arena.release(segment)
    with pytest.raises(RuntimeError, match="released more often"):
        arena.release(segment)
    with pytest.raises(RuntimeError, match="freed"):
        arena.lease(segment)


def test_a_kept_segment_outlives_its_leases_and_is_found_by_key() -> None:
    arena = Arena(4 * MB)
    segment = arena.allocate(MB)
    assert segment is not None
    assert arena.keep(segment, "cat.jpg") is segment
    arena.release(segment)
    assert arena.cached_bytes == MB
    assert arena.leased_bytes == 0
    found = arena.lookup("cat.jpg")
    assert found is segment
    assert arena.leased_bytes == MB
    assert arena.lookup("dog.jpg") is None


def test_eviction_frees_only_segments_nobody_leases_oldest_first() -> None:
    arena = Arena(3 * MB)
    a, b, c = (arena.allocate(MB) for _ in range(3))
    assert a is not None
    assert b is not None
    assert c is not None
    for key, segment in (("a", a), ("b", b), ("c", c)):
        arena.keep(segment, key)
    arena.release(a)  # idle, oldest
    arena.release(c)  # idle, newest
    # b is still leased by a request: it must survive any eviction.
    fresh = arena.allocate(MB)
    assert fresh is not None
    assert fresh.address == a.address, "the least recently used idle segment goes first"
    assert arena.lookup("a") is None
    assert arena.lookup("b") is b
    assert arena.allocate(MB) is not None  # evicts c, the last idle one
    assert arena.allocate(MB) is None, "b is leased twice now and a and c are taken"


def test_a_lookup_refreshes_a_segment_in_the_lru_order() -> None:
    arena = Arena(2 * MB)
    a, b = arena.allocate(MB), arena.allocate(MB)
    assert a is not None
    assert b is not None
    arena.keep(a, "a")
    arena.keep(b, "b")
    arena.release(a)
    arena.release(b)
    found = arena.lookup("a")  # now a is the most recently used
    assert found is a
    arena.release(a)
    assert arena.allocate(MB) is not None
    assert arena.lookup("b") is None
    assert arena.lookup("a") is a


def test_cache_bytes_bounds_what_stays_once_idle() -> None:
    arena = Arena(4 * MB, cache_bytes=MB)
    a, b = arena.allocate(MB), arena.allocate(MB)
    assert a is not None
    assert b is not None
    arena.keep(a, "a")
    arena.keep(b, "b")
    assert arena.cached_bytes == 2 * MB  # both leased: nothing may be evicted yet
    arena.release(a)
    assert arena.lookup("a") is None, "over the bound once idle: evicted"
    arena.release(b)
    assert arena.cached_bytes == MB
    assert arena.free_bytes == 3 * MB


def test_no_cache_means_segments_go_back_when_released() -> None:
    arena = Arena(MB, cache_bytes=0)
    segment = arena.allocate(MB)
    assert segment is not None
    arena.keep(segment, "a")
    arena.release(segment)
    assert arena.lookup("a") is None
    assert arena.free_bytes == arena.nbytes


def test_a_second_segment_for_a_kept_key_does_not_replace_the_first() -> None:
    arena = Arena(2 * MB)
    a, b = arena.allocate(MB), arena.allocate(MB)
    assert a is not None
    assert b is not None
    arena.keep(a, "same")
    assert arena.keep(b, "same") is a
    arena.release(b)
    assert arena.free_bytes == MB, "the duplicate goes back when its holders are done"


async def test_allocate_by_waits_for_a_release_within_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    arena = Arena(MB)
    held = arena.allocate(MB)
    assert held is not None

    async def release_later() -> None:
        await trio.sleep(2)
        arena.release(held)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_later)
        segment = await arena.allocate_by(MB, trio.current_time() + 5)
    assert segment is not None
    assert trio.current_time() == pytest.approx(2)


async def test_allocate_by_gives_up_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    arena = Arena(MB)
    assert arena.allocate(MB) is not None
    assert await arena.allocate_by(MB, trio.current_time() + 3) is None
    assert trio.current_time() == pytest.approx(3)


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive size"):
        Arena(0)
    with pytest.raises(ValueError, match="positive size"):
        Arena(MB).allocate(0)
