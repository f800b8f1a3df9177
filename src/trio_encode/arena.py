"""The registered arena: one block of memory, registered once, carved into embedding segments.

Registering memory with an RDMA NIC pins its pages, which costs about as much as sending them.
Registering each request's embedding (as SGLang does per ``req_id`` and Dynamo per send) pays
that on every request. So the server allocates one arena at start, registers it once for the
process's life, and the encoder writes each image's embedding straight into a segment of it.
A request's embedding is then the list of its images' segments, sent with one batched call:
no registration, no concatenation, no copy on the send path.

The arena is also the embedding cache: a segment that holds an image's embedding may stay
after its last request, under the image's key, so the next request for that image leases it
again. Eviction (least recently used first) frees only segments that nobody leases, so no
segment can be reused while a transfer might read it.

This module knows nothing of torch, the engine or HTTP: only offsets, lengths and leases. It
is used from the event loop only; the bytes of a segment may be written from a worker thread
while the segment is leased.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import trio

ALIGN = 4096
"""Segments start on page boundaries: no two segments share a page the NIC pins or a cache
line two threads write."""


class FreeRanges:
    """The free ``(offset, length)`` ranges of a pool, sorted, neighbours merged: taken first
    fit, given back merged so large ranges stay possible."""

    def __init__(self, nbytes: int) -> None:
        self._ranges: list[tuple[int, int]] = [(0, nbytes)]

    @property
    def total(self) -> int:
        return sum(length for _, length in self._ranges)

    def take(self, size: int) -> int | None:
        """The offset of ``size`` bytes now taken from the first range that holds them."""
        for index, (offset, length) in enumerate(self._ranges):
            if length >= size:
                if length == size:
                    del self._ranges[index]
                else:
                    self._ranges[index] = (offset + size, length - size)
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        index = bisect.bisect(self._ranges, (offset, size))
        self._ranges.insert(index, (offset, size))
        merged: list[tuple[int, int]] = []
        for start, length in self._ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._ranges = merged


@dataclass(eq=False)
class Segment:
    """``nbytes`` bytes of the arena at ``offset``; alive while leased or cached."""

    arena: Arena
    offset: int
    nbytes: int
    """The bytes asked for (the arena reserves them rounded up to :data:`ALIGN`)."""
    leases: int = 1
    key: Hashable | None = None
    """The cache key it is kept under, once the arena keeps it."""
    freed: bool = field(default=False)

    @property
    def address(self) -> int:
        return self.arena.address + self.offset

    @property
    def buffer(self) -> memoryview:
        """The segment's bytes, writable, without a copy."""
        if self.freed:
            raise RuntimeError("the segment was freed")
        return self.arena.view[self.offset : self.offset + self.nbytes]


class Arena:
    """A fixed block of anonymous memory carved into segments (first fit, merged on free)."""

    def __init__(self, nbytes: int, *, cache_bytes: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"an arena needs a positive size, got {nbytes}")
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        self._memory = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._memory)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        self.cache_bytes = self.nbytes if cache_bytes is None else min(cache_bytes, self.nbytes)
        """At most this many bytes stay cached once no request leases them (0: none)."""
        self._free = FreeRanges(self.nbytes)
        self._cached: OrderedDict[Hashable, Segment] = OrderedDict()  # LRU first
        self.leased_bytes = 0
        """Bytes of segments that a request (or a forward writing them) holds now."""
        self.cached_bytes = 0
        """Bytes of segments kept under a key (leased or not)."""
        self._released = trio.Event()
        self.fallbacks = 0
        """Requests whose embedding did not lie wholly in the arena (some image found no room)
        and took the per-request registration path; counted by whoever makes the embedding."""

    # -- what the gauges read -----------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self._free.total

    def __len__(self) -> int:
        """Segments cached now."""
        return len(self._cached)

    # -- leasing -----------------------------------------------------------------------------

    def lookup(self, key: Hashable) -> Segment | None:
        """The segment kept under ``key``, leased once more; None if there is none."""
        segment = self._cached.get(key)
        if segment is None:
            return None
        self._cached.move_to_end(key)
        self.lease(segment)
        return segment

    def allocate(self, nbytes: int) -> Segment | None:
        """A new segment of ``nbytes`` leased once, evicting idle cached segments if needed;
        None if the arena has no room even then. The segment's bytes are not cleared."""
        if nbytes <= 0:
            raise ValueError(f"a segment needs a positive size, got {nbytes}")
        size = _reserved(nbytes)
        while (offset := self._free.take(size)) is None:
            if not self._evict_one():
                return None
        self.leased_bytes += size
        return Segment(self, offset, nbytes)

    async def allocate_by(self, nbytes: int, deadline: float) -> Segment | None:
        """:meth:`allocate`, waiting for releases until ``deadline`` (Trio time) if the arena
        is full; None if it is still full then."""
        while (segment := self.allocate(nbytes)) is None:
            if trio.current_time() >= deadline:
                return None
            with trio.move_on_at(deadline):
                await self._released.wait()
        return segment

    def lease(self, segment: Segment) -> None:
        """One more holder of ``segment``."""
        if segment.freed:
            raise RuntimeError("cannot lease a freed segment")
        if segment.leases == 0:
            self.leased_bytes += _reserved(segment.nbytes)
        segment.leases += 1

    def release(self, segment: Segment) -> None:
        """One holder fewer; the last one frees the segment unless the arena keeps it."""
        if segment.leases <= 0:
            raise RuntimeError("segment released more often than leased")
        segment.leases -= 1
        if segment.leases > 0:
            return
        size = _reserved(segment.nbytes)
        self.leased_bytes -= size
        if segment.key is not None:
            self._trim_cache()
        else:
            self._give_back(segment)
        self._wake()  # an idle cached segment is room too: a waiter may evict it

    def keep(self, segment: Segment, key: Hashable) -> Segment:
        """Keep ``segment`` under ``key`` after its leases end (the cache). If another segment
        is already kept under ``key``, that one stays and ``segment`` is left as it was;
        returns the one kept."""
        kept = self._cached.get(key)
        if kept is not None:
            self._cached.move_to_end(key)
            return kept
        if self.cache_bytes <= 0 or segment.freed or segment.key is not None:
            return segment
        segment.key = key
        self._cached[key] = segment
        self.cached_bytes += _reserved(segment.nbytes)
        self._trim_cache()
        return segment

    def discard(self, segment: Segment) -> None:
        """Stop keeping ``segment`` under its key (its bytes are not what was kept): no
        lookup finds it again, and it is freed once its last lease is given back."""
        key = segment.key
        if key is not None and self._cached.get(key) is segment:
            self._forget(key, segment)

    # -- internals ---------------------------------------------------------------------------

    def _wake(self) -> None:
        """Wake every :meth:`allocate_by` waiter to try again."""
        self._released.set()
        self._released = trio.Event()

    def _give_back(self, segment: Segment) -> None:
        """Return a segment's bytes to the free list, and wake the waiters: whatever freed
        them (a release, an eviction by :meth:`keep` or :meth:`allocate`), there is room."""
        segment.freed = True
        self._free.give(segment.offset, _reserved(segment.nbytes))
        self._wake()

    def _evict_one(self) -> bool:
        """Free the least recently used cached segment that nobody leases; False if none."""
        for key, segment in self._cached.items():
            if segment.leases == 0:
                self._forget(key, segment)
                return True
        return False

    def _forget(self, key: Hashable, segment: Segment) -> None:
        del self._cached[key]
        segment.key = None
        self.cached_bytes -= _reserved(segment.nbytes)
        if segment.leases == 0:
            self._give_back(segment)

    def _trim_cache(self) -> None:
        """Evict idle cached segments while the cache holds more than ``cache_bytes``."""
        while self.cached_bytes > self.cache_bytes and self._evict_one():
            pass


def _reserved(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
