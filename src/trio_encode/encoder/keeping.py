"""Where the encoder keeps the embeddings it computed, and how it finds them again.

Two levels, nearest first. The local one is the registered arena when there is one
(:mod:`trio_encode.arena`: a kept row is a segment, sent as it lies) and plain memory
otherwise (:class:`~trio_encode.encoder.cache.EmbeddingCache`); the second is the cluster-wide
store (:mod:`trio_encode.encoder.store`), shared by every encoder of a fleet. The batcher writes
each row a forward computes through :meth:`EmbeddingKeeper.keep`, once; the front reads a
request's items through :meth:`EmbeddingKeeper.find`, once, encodes what both levels miss and
has :meth:`EmbeddingKeeper.embedding` make the request's embedding of the rows. Every modality
is kept alike: an item's key names its modality and recipe (:class:`CacheKey`), and its row is
kept with its grid and metadata (a video's timestamps), at both levels, so a hit answers
exactly as the forward did.

Kept memory is registered with the transfer engine (the arena for the server's life, a cached
row while a request sends it), so whoever reaches the engine's port can write it. So every
local hit, whichever memory it lies in, is compared with the checksum recorded when its bytes
were written, by one function (:func:`_intact`) in a worker thread, before it is served; a
mismatch is dropped, counted, logged and encoded again. The store checks its own entries
(their digest, or the fleet's seal) in its read thread, and a store hit kept here is recorded
with the checksum that check confirmed.

Used from the event loop only; blocking work (hashing, copies) goes to the worker threads.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import torch
import trio

from trio_encode.arena import Arena, Segment
from trio_encode.embedding import ArenaEmbedding, Embedding, RowsEmbedding, tensor_checksum
from trio_encode.encoder.backend import ItemMeta, VisionModel
from trio_encode.encoder.cache import CacheKey, EmbeddingCache
from trio_encode.encoder.observer import EncoderObserver
from trio_encode.encoder.store import EmbeddingStore, store_key
from trio_encode.request_types import IMAGES, Grid, Media, MediaMeta

log = logging.getLogger(__name__)

T = TypeVar("T")

ARENA_WAIT = 0.5
"""Seconds a request waits for arena room for its new images (never past its deadline)
before they go to ordinary memory and the request registers its own embedding."""


class ThreadRunner(Protocol):
    """Runs a blocking function off the event loop (``trio.to_thread.run_sync`` by default;
    tests inject one that runs inline, to keep real threads off the mock clock)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


@dataclass(frozen=True, eq=False)
class Kept:
    """One item's (an image's, a video's) embedding row as the encoder holds it."""

    row: torch.Tensor
    """``(tokens, hidden)``, contiguous, on the CPU (a view of ``segment`` when it has one)."""
    grid: Grid | None
    """The grid its model used (None: a fixed-grid model)."""
    checksum: str | None
    """Of its bytes as written, what a later hit is compared with (None: no level keeps the
    row, so none was computed)."""
    segment: Segment | None = None
    """The arena segment the row lies in. Whoever holds this record holds one lease on it."""
    meta: ItemMeta = ()
    """What SGLang's prefill reads beside the row (a video's timestamps or seconds per grid),
    by name; kept with the row at every level, so a hit answers as the forward did."""


def release(kept: Iterable[Kept | None]) -> None:
    """Give back the segment lease each record holds (one without a segment holds none)."""
    for one in kept:
        if one is not None and one.segment is not None:
            one.segment.arena.release(one.segment)


class _Local(Protocol):
    """The local level: one of :class:`_InArena` and :class:`_InMemory`."""

    source: str
    """What the poisoned-row count calls it."""

    def find(self, key: CacheKey) -> Kept | None:
        """The row kept under ``key`` (its segment leased once more for the caller)."""

    def keep(self, key: CacheKey, kept: Kept) -> Kept:
        """Keep ``kept`` under ``key`` unless a row is kept there already (that one stays).
        Returns the arena's record under ``key`` when another request kept its copy first,
        else ``kept``. Leases are left as they are."""

    def drop(self, key: CacheKey, kept: Kept) -> bool:
        """Stop keeping ``kept`` (its bytes are not what was written) and give back the
        caller's lease; whether it was still the row kept under ``key``."""

    def size(self) -> tuple[int, int]:
        """Bytes and entries kept now."""


class _InArena:
    """The arena as the local level: a kept row is a segment the arena keeps under the image's
    key (evicted least recently used first, never while leased); its grid and checksum are
    recorded here, beside it."""

    source = "arena"

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._written: dict[CacheKey, Kept] = {}
        """The record of each kept segment (and of some the arena has since evicted, until
        the next prune)."""

    def find(self, key: CacheKey) -> Kept | None:
        segment = self.arena.lookup(key)
        if segment is None:
            return None
        kept = self._written.get(key)
        if kept is None or kept.segment is not segment:  # never written here: never served
            self.arena.release(segment)
            return None
        return kept

    def keep(self, key: CacheKey, kept: Kept) -> Kept:
        segment = kept.segment
        if segment is None:
            return kept  # a row outside the arena is not kept locally
        held = self.arena.keep(segment, key)
        if held is segment:
            if segment.key is not None:  # the arena keeps it (none when its cache is off)
                self._written[key] = kept
                self._prune()
            return kept
        found = self._written.get(key)
        return found if found is not None and found.segment is held else kept

    def drop(self, key: CacheKey, kept: Kept) -> bool:
        assert kept.segment is not None
        self.arena.discard(kept.segment)
        if self._written.get(key) is kept:
            del self._written[key]
        self.arena.release(kept.segment)
        return True

    def size(self) -> tuple[int, int]:
        return self.arena.cached_bytes, len(self.arena)

    def _prune(self) -> None:
        """Forget the records of segments the arena no longer keeps, once they are as many
        as those it keeps (so pruning costs O(1) a keep, amortised)."""
        if len(self._written) > 2 * len(self.arena) + 16:
            self._written = {
                key: kept
                for key, kept in self._written.items()
                if kept.segment is not None and kept.segment.key == key
            }


class _InMemory:
    """Plain memory as the local level (no arena): :class:`EmbeddingCache`."""

    source = "cache"

    def __init__(self, cache: EmbeddingCache) -> None:
        self.cache = cache

    def find(self, key: CacheKey) -> Kept | None:
        row = self.cache.get(key)
        if row is None:
            return None
        return Kept(row, self.cache.grid(key), self.cache.digest(key), meta=self.cache.meta(key))

    def keep(self, key: CacheKey, kept: Kept) -> Kept:
        assert kept.checksum is not None
        self.cache.put(key, kept.row, kept.checksum, kept.grid, kept.meta)
        return kept

    def drop(self, key: CacheKey, kept: Kept) -> bool:
        return self.cache.discard(key, kept.row)

    def size(self) -> tuple[int, int]:
        return self.cache.nbytes, len(self.cache)


@dataclass(eq=False)
class _StoreRead:
    """One image being read from the store, shared by every request that needs it."""

    done: trio.Event = field(default_factory=trio.Event)
    found: Kept | None = None
    """The row read, with the checksum the store found it to match and the grid and metadata
    stored with it (None: not found)."""


class EmbeddingKeeper:
    """The levels, and the one way in and out of them."""

    def __init__(
        self,
        model: VisionModel,
        *,
        cache_bytes: int,
        arena: Arena | None,
        store: EmbeddingStore | None,
        observer: EncoderObserver,
        in_worker_thread: ThreadRunner,
    ) -> None:
        self.model = model
        self.arena = arena
        self.cache = EmbeddingCache(cache_bytes) if cache_bytes > 0 and arena is None else None
        """Plain memory as the local level; None with an arena (``cache_bytes`` then bounds
        what the arena keeps) or with ``cache_bytes`` 0."""
        self.local: _Local | None = (
            _InArena(arena)
            if arena is not None
            else _InMemory(self.cache)
            if self.cache is not None
            else None
        )
        self.store = store
        self.observer = observer
        self.in_worker_thread = in_worker_thread
        self._token_bytes = model.hidden_size * model.dtype.itemsize
        self._store_reads: dict[CacheKey, _StoreRead] = {}

    @property
    def checksums_rows_outside_the_arena(self) -> bool:
        """Whether a row outside the arena is kept anywhere (in plain memory or the store), so
        the forward records its checksum; a row in a segment always gets one."""
        return self.cache is not None or self.store is not None

    # -- memory for new rows -------------------------------------------------------------------

    def row_bytes(self, tokens: int) -> int:
        """Bytes of an image's embedding of ``tokens`` rows."""
        return tokens * self._token_bytes

    def row_view(self, segment: Segment) -> torch.Tensor:
        """An image's ``(tokens, hidden)`` row as a view of its segment's bytes."""
        flat = torch.frombuffer(segment.buffer, dtype=torch.uint8)
        return flat.view(self.model.dtype).view(-1, self.model.hidden_size)

    async def reserve(self, tokens: Sequence[int]) -> list[Segment | None]:
        """A segment for each of a request's new images (of ``tokens`` rows each), waiting for
        room while the arena is full, for at most :data:`ARENA_WAIT` and never past the
        caller's deadline (the request scope's backstop). None where time ran out, or for an
        image bigger than the arena: those go to ordinary memory and the request registers its
        own (a fallback)."""
        if self.arena is None:
            return [None] * len(tokens)
        deadline = min(trio.current_effective_deadline(), trio.current_time() + ARENA_WAIT)
        room: list[Segment | None] = []
        try:
            for count in tokens:
                nbytes = self.row_bytes(count)
                segment = None
                if nbytes <= self.arena.nbytes and trio.current_time() < deadline:
                    segment = await self.arena.allocate_by(nbytes, deadline)
                room.append(segment)
        except BaseException:
            release_segments(room)
            raise
        return room

    def room_now(self, tokens: int) -> Segment | None:
        """A segment for a row of ``tokens`` rows if the arena has room now (none: None)."""
        nbytes = self.row_bytes(tokens)
        if self.arena is None or nbytes > self.arena.nbytes:
            return None
        return self.arena.allocate(nbytes)

    # -- writing -------------------------------------------------------------------------------

    def keep(self, key: CacheKey, kept: Kept) -> None:
        """Keep a row a forward just wrote at every level: here (a row in the arena, or any row
        in plain memory) and in the store (offered; the put runs in the background)."""
        if self.local is not None and kept.checksum is not None:
            self.local.keep(key, kept)
        if self.store is not None:
            self._offer(key, kept)

    def report_size(self) -> None:
        """Tell the observer what the local level holds now."""
        if self.local is not None:
            self.observer.cache_size(*self.local.size())

    def _offer(self, key: CacheKey, kept: Kept) -> None:
        """Offer a row to the store. The put reads it later, in the background: a row in the
        arena is a view of its segment, so the put holds a lease on the segment until it no
        longer reads it (an abandoned put too). Without it the segment could be evicted and
        refilled meanwhile, and the store would keep another image's bytes under this key."""
        assert self.store is not None
        assert kept.checksum is not None
        segment, done = kept.segment, None
        if segment is not None:
            segment.arena.lease(segment)
            done = partial(segment.arena.release, segment)
        self.store.put(
            store_key(self.model.fingerprint, key),
            kept.row,
            kept.checksum,
            done,
            grid=kept.grid,
            meta=kept.meta,
        )

    # -- reading -------------------------------------------------------------------------------

    async def find(
        self, keys: Sequence[CacheKey], in_flight: Container[CacheKey]
    ) -> list[Kept | None]:
        """Each image's kept row (None: a miss), from the local level, else from the store:
        each verified, each holding its own lease on its segment. An image in ``in_flight``
        (queued or in a forward here) is not looked up in the store: joining that forward is
        cheaper."""
        found: dict[CacheKey, Kept] = {}
        try:
            if self.local is not None:
                candidates: dict[CacheKey, Kept] = {}
                for key in dict.fromkeys(keys):
                    if (kept := self.local.find(key)) is not None:
                        candidates[key] = kept
                found = await self._verified(candidates)
                hits = sum(key in found for key in keys)
                self.observer.cache_looked_up(hits, len(keys) - hits)
            if self.store is not None:
                wanted = [k for k in dict.fromkeys(keys) if k not in found and k not in in_flight]
                if wanted:
                    found.update(await self._from_store(wanted))
        except BaseException:
            release(found.values())
            raise
        return _per_image(keys, found)

    async def _verified(self, candidates: dict[CacheKey, Kept]) -> dict[CacheKey, Kept]:
        """The local hits whose bytes still match their checksum; the others are dropped from
        the local level (their leases given back), counted and logged: never served."""
        if not candidates:
            return {}
        assert self.local is not None
        intact = await self.in_worker_thread(partial(_intact, list(candidates.values())))
        good: dict[CacheKey, Kept] = {}
        mismatched = dropped = 0
        for (key, kept), ok in zip(candidates.items(), intact, strict=True):
            if ok:
                good[key] = kept
            else:
                mismatched += 1
                dropped += self.local.drop(key, kept)
        if mismatched:
            if dropped:
                self.observer.cache_poisoned(dropped, self.local.source)
                self.report_size()
            log.warning(
                "%d kept embeddings (%s) no longer match their checksum: dropped and encoded "
                "again (something wrote into registered memory)",
                mismatched,
                self.local.source,
            )
        return good

    async def _from_store(self, keys: list[CacheKey]) -> dict[CacheKey, Kept]:
        """The images the store holds (checked by the store against what it stored with
        them), kept here too. An image another request is already reading waits for that read;
        one the store lacks but the local level holds by now (a forward elsewhere finished
        meanwhile) is taken from there, verified as every local hit is."""
        assert self.store is not None
        own = [key for key in keys if key not in self._store_reads]
        others = {key: self._store_reads[key] for key in keys if key not in own}
        reads = {key: _StoreRead() for key in own}
        self._store_reads.update(reads)
        try:
            if reads:
                into = [self._landing_row() for _ in reads]
                fingerprint = self.model.fingerprint
                found = await self.store.get([store_key(fingerprint, k) for k in reads], into)
                # A miss's tensor may still be written by an abandoned read: it is dropped.
                for read, row, hit in zip(reads.values(), into, found, strict=True):
                    read.found = (
                        None if hit is None else Kept(row, hit.grid, hit.checksum, None, hit.meta)
                    )
        finally:
            # Whatever happened (a cancelled caller too), those waiting on these reads go on.
            for key, read in reads.items():
                read.done.set()
                if self._store_reads.get(key) is read:
                    del self._store_reads[key]
        for read in others.values():
            await read.done.wait()  # bounded: the reading request's lookup is
        hits: dict[CacheKey, Kept] = {}
        late: dict[CacheKey, Kept] = {}
        try:
            for key in keys:
                stored = (reads.get(key) or others[key]).found
                if stored is not None:
                    hits[key] = await self._keep_store_hit(key, stored)
                elif self.local is not None and (kept := self.local.find(key)) is not None:
                    late[key] = kept
            hits.update(await self._verified(late))
        except BaseException:
            release(hits.values())
            raise
        return hits

    async def _keep_store_hit(self, key: CacheKey, stored: Kept) -> Kept:
        """Keep a store hit here; the record to serve (holding a lease if in the arena). In the
        arena it is copied into a segment, so the request is sent from the arena (no
        registration) and the next one finds it here; a store read lands in memory of its own
        (an abandoned read may still write it), hence the copy. With the arena full the hit
        stays where it landed, kept nowhere, and the request registers its own memory."""
        if self.local is None:
            return stored
        if self.arena is None:
            self.local.keep(key, stored)
            return stored
        segment = self.room_now(int(stored.row.shape[0]))
        if segment is None:
            return stored
        try:
            row = self.row_view(segment)
            await self.in_worker_thread(partial(row.copy_, stored.row))
        except BaseException:
            segment.arena.release(segment)
            raise
        # Recorded with the checksum the store's entry was checked against, not one of the
        # copy: a write into the segment meanwhile is caught by the next hit, not recorded.
        copied = Kept(row, stored.grid, stored.checksum, segment, stored.meta)
        kept = self.local.keep(key, copied)
        if kept is not copied and kept.segment is not None:  # another request kept it first
            kept.segment.arena.lease(kept.segment)
            segment.arena.release(segment)
        return kept

    def _landing_row(self) -> torch.Tensor:
        """Memory for one image's embedding read from the store: the tensor the request then
        sends from and the cache keeps, so a hit is never copied. An abandoned read may still
        write it after the lookup gave up (the store keeps it alive until then); whatever
        provides this memory must not reuse it while a reference to it remains."""
        model = self.model
        assert model.fixed_tokens is not None  # the store is refused for other models
        return torch.empty(model.fixed_tokens, model.hidden_size, dtype=model.dtype)

    # -- the request's embedding ---------------------------------------------------------------

    async def embedding(
        self, rows: Sequence[Kept], modality: str = "IMAGE"
    ) -> Embedding | RowsEmbedding:
        """The request's embedding of its images' rows, its checksum computed in a worker
        thread. It takes over the rows' segment leases once it is returned (the caller gives
        them back if this raises). A request whose every row lies in the arena is sent from
        there; one that does not (some image found no room) registers its own memory: counted
        as the arena's fallback."""
        segments = [kept.segment for kept in rows]
        grids = [kept.grid for kept in rows]
        media = IMAGES if modality == "IMAGE" else Media(modality, _part_meta(rows))
        if self.arena is not None and all(segment is not None for segment in segments):
            parts = [(kept.segment, kept.row) for kept in rows if kept.segment is not None]
            embedding = ArenaEmbedding(parts, grids, media)
            return await self.in_worker_thread(partial(_checksummed, embedding))
        if self.arena is not None:
            self.arena.fallbacks += 1
        return await self.in_worker_thread(
            partial(_assemble, [kept.row for kept in rows], grids, segments, media)
        )


def _part_meta(rows: Sequence[Kept]) -> MediaMeta:
    """A part's metadata: for each name its items carry, the list of their values in order
    (SGLang's prefill chains such lists across a request's parts)."""
    names = list(dict.fromkeys(name for kept in rows for name, _ in kept.meta))
    values = [dict(kept.meta) for kept in rows]
    meta: list[tuple[str, Any]] = [
        (name, [value[name] for value in values if name in value]) for name in names
    ]
    return tuple(meta)


def worker_threads(count: int) -> ThreadRunner:
    """A pool of ``count`` worker threads for a request's blocking work (decoding, hashing,
    copies), apart from the forward's: a burst of big images cannot take every core from it."""
    limiter = trio.CapacityLimiter(count)

    async def in_worker_thread(fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn, limiter=limiter)

    return in_worker_thread


def release_segments(segments: Iterable[Segment | None]) -> None:
    """Give back the lease held on each segment (None: no segment, nothing to give back)."""
    for segment in segments:
        if segment is not None:
            segment.arena.release(segment)


def _per_image(keys: Sequence[CacheKey], found: dict[CacheKey, Kept]) -> list[Kept | None]:
    """``found`` (one lease per image) in the order of ``keys``: an image a request names
    again takes one more lease, so every entry holds its own."""
    seen: set[CacheKey] = set()
    rows: list[Kept | None] = []
    for key in keys:
        kept = found.get(key)
        if kept is not None and kept.segment is not None and key in seen:
            kept.segment.arena.lease(kept.segment)
        seen.add(key)
        rows.append(kept)
    return rows


def _intact(found: Sequence[Kept]) -> list[bool]:
    """In a worker thread: whether each hit's bytes still match the checksum recorded when
    they were written (one without a record never matches). The one check every local hit
    passes before it is served."""
    return [
        kept.checksum is not None and tensor_checksum(kept.row) == kept.checksum for kept in found
    ]


def _checksummed(embedding: ArenaEmbedding) -> ArenaEmbedding:
    """In a worker thread: compute the checksum (it reads every byte)."""
    embedding.checksum  # noqa: B018 - computed here, remembered by the embedding
    return embedding


def _assemble(
    rows: list[torch.Tensor],
    grids: Sequence[Grid | None],
    segments: Sequence[Segment | None],
    media: Media = IMAGES,
) -> Embedding | RowsEmbedding:
    """In a worker thread: the request's rows as one embedding, never concatenated (each row
    is sent as it lies, so a request naming one cached image many times copies nothing), its
    checksum computed (it reads every byte, so not on the event loop). Rows that lie in arena
    segments keep their leases in the embedding until it is released."""
    held = [segment for segment in segments if segment is not None]
    if len(rows) == 1 and not held:
        embedding: Embedding | RowsEmbedding = Embedding(
            rows[0], tuple(grids), (int(rows[0].shape[0]),), media
        )
    else:
        embedding = RowsEmbedding(rows, grids, leases=held, media=media)
    embedding.checksum  # noqa: B018 - computed here, remembered by the embedding
    return embedding
