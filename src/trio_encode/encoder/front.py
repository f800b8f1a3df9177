"""The encoder's front: one ``encode()`` per request, from image bytes to its embedding.

:class:`ImageEncoder` is what the service calls. It loads a request's items (fetching
``http(s)`` ones under the fetch rules), admits or refuses the request (a full queue is
:class:`Overloaded`; an encoder not running yet, or stopped, refuses too), and looks each image
up in this encoder's cache (or arena), then (when configured) in the cluster-wide store
(:mod:`trio_encode.encoder.store`). Only what both miss goes to the batcher
(:mod:`trio_encode.encoder.batcher`), which runs one forward pass for many requests.

An image (by content key) that is already queued or in a forward is not queued again: a
second request waits for the same job and gets the same row. A caller cancelled while its
images are still queued takes them out of the queue unless another request still waits for
them (they are never encoded for nobody); one cancelled while its batch runs simply does not
receive the result.

With a registered arena (:mod:`trio_encode.arena`) the arena is the cache, and a request whose
every image has a segment gets an :class:`ArenaEmbedding` of them: nothing to register,
nothing to concatenate. An image that finds no room in the arena is encoded into ordinary
memory, and its request takes the per-request registration path (counted as a fallback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import trio

from trio_encode.arena import Arena, Segment
from trio_encode.embedding import (
    DTYPE_NAMES,
    TORCH_DTYPES,
    ArenaEmbedding,
    Embedding,
    RowsEmbedding,
    checksum_of,
    tensor_checksum,
)
from trio_encode.encoder.backend import (
    FixedShape,
    Prepared,
    VisionBackend,
    VisionModel,
    as_model,
)
from trio_encode.encoder.batcher import Batcher, Job, ThreadRunner, release_all
from trio_encode.encoder.cache import CacheKey, EmbeddingCache, content_key
from trio_encode.encoder.fetch import FetchPolicy, RemoteFetcher, is_remote
from trio_encode.encoder.images import ImageTooBig, image_pixels, load_item
from trio_encode.encoder.loader import load_backend
from trio_encode.encoder.observer import EncoderObserver, NullEncoderObserver
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.store import EmbeddingStore, store_key
from trio_encode.errors import InvalidInput, NotReady, Overloaded, RequestError, ShuttingDown
from trio_encode.request_types import Grid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderInfo:
    """What the service reports about the encoder (and /health shows)."""

    model_id: str
    tokens_per_image: int | None
    """Rows of every image's embedding; None for a model whose images vary (dynamic
    resolution, tiles), whose answers give each image's count."""
    hidden_size: int
    dtype: str
    image_size: int | None
    """The square side a fixed-grid model resizes to (None: the model's processor decides)."""
    max_batch_size: int
    device: str = "cpu"

    @property
    def bytes_per_image(self) -> int | None:
        """Bytes of every image's embedding (None when images vary)."""
        if self.tokens_per_image is None:
            return None
        return self.tokens_per_image * self.hidden_size * TORCH_DTYPES[self.dtype].itemsize


@dataclass(eq=False)
class _Request:
    """One encode() call's images that missed the cache, and where their rows go."""

    results: list[torch.Tensor | None]
    grids: list[Grid | None]
    remaining: int
    segments: list[Segment | None]
    """The arena segment behind each result, leased by this request (None: not in the arena)."""
    done: trio.Event = field(default_factory=trio.Event)
    error: RequestError | None = None
    jobs: set[Job] = field(default_factory=set)  # what it waits on, to withdraw from

    def deliver(
        self, index: int, row: torch.Tensor, grid: Grid | None, segment: Segment | None
    ) -> None:
        if not self.done.is_set():
            if segment is not None:
                segment.arena.lease(segment)
                self.segments[index] = segment
            self.results[index] = row
            self.grids[index] = grid
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()

    def fail(self, error: RequestError) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


@dataclass(eq=False)
class _StoreRead:
    """One image being read from the store, shared by every request that needs it."""

    done: trio.Event = field(default_factory=trio.Event)
    row: torch.Tensor | None = None
    checksum: str | None = None
    """The row's checksum, as the store holds it and the row was found to match."""


class ImageEncoder:
    """The encoder the service uses: ``encode()`` per request, ``run()`` in its nursery."""

    def __init__(
        self,
        backend: VisionModel | VisionBackend,
        settings: EncoderSettings | None = None,
        *,
        observer: EncoderObserver | None = None,
        run_decode: ThreadRunner | None = None,
        run_forward: ThreadRunner | None = None,
        store: EmbeddingStore | None = None,
        arena: Arena | None = None,
    ) -> None:
        self.backend = backend
        """The model as given."""
        self.model = as_model(backend)
        """The model as the batcher drives it (a fixed-grid backend adapted)."""
        self.store = store
        self.settings = settings if settings is not None else EncoderSettings()
        if store is not None and self.model.fixed_tokens is None:
            raise ValueError(
                "the cluster-wide store (store_master) needs a model with one token count per "
                f"image; {self.model.model_id} varies it per image"
            )
        self.observer: EncoderObserver = observer or NullEncoderObserver()
        self._arena = arena
        if arena is not None and self.model.device.type == "cuda":
            pin_for_cuda(arena)
        # With an arena, the arena is the cache (``cache_bytes`` bounds what it keeps).
        self._cache = (
            EmbeddingCache(self.settings.cache_bytes)
            if self.settings.cache_bytes > 0 and arena is None
            else None
        )
        self._fetcher = RemoteFetcher(
            FetchPolicy.build(
                enabled=self.settings.remote_fetch,
                hosts=self.settings.remote_hosts,
                private_networks=self.settings.remote_private_networks,
                max_bytes=self.settings.max_image_bytes,
                timeout=self.settings.remote_timeout,
                max_redirects=self.settings.remote_max_redirects,
            )
        )
        self._store_reads: dict[CacheKey, _StoreRead] = {}
        model = self.model
        self.info = EncoderInfo(
            model_id=model.model_id,
            tokens_per_image=model.fixed_tokens,
            hidden_size=model.hidden_size,
            dtype=DTYPE_NAMES[model.dtype],
            image_size=model.preprocess.image_size if isinstance(model, FixedShape) else None,
            max_batch_size=self.settings.max_batch_size,
            device=str(model.device),
        )
        self.batcher = Batcher(
            model,
            self.settings,
            observer=self.observer,
            cache=self._cache,
            arena=arena,
            store=store,
            run_decode=run_decode,
            run_forward=run_forward,
        )
        """Queues the images no forward is computing yet and runs them in batches."""

    @classmethod
    def from_settings(
        cls,
        settings: EncoderSettings,
        *,
        observer: EncoderObserver | None = None,
        store: EmbeddingStore | None = None,
        arena: Arena | None = None,
    ) -> ImageEncoder:
        """Load the model the settings name. Blocking: call before serving or in a thread.

        ``arena``: the one to write embeddings into; by default :func:`arena_for` makes it
        from the settings (none when ``arena_bytes`` is 0). A server that loads the model
        behind a listening port makes it first, so that it is registered at start.
        """
        arena = arena if arena is not None else arena_for(settings)
        return cls(load_backend(settings), settings, observer=observer, store=store, arena=arena)

    @property
    def ready(self) -> bool:
        """True while :meth:`run` is serving batches (after its warm-up forward)."""
        return self.batcher.running

    @property
    def cache(self) -> EmbeddingCache | None:
        return self._cache

    @property
    def arena(self) -> Arena | None:
        """Where embeddings are written (and cached); None: ordinary memory."""
        return self._arena

    @property
    def queued_images(self) -> int:
        """Images waiting for a forward pass, including those still being decoded."""
        return self.batcher.queued_images

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve batches until cancelled. Reports started (and ``ready``) after a warm-up
        forward pass; on exit, every request still waiting gets :class:`ShuttingDown`. The
        store (if any) connects in the background: the encoder is ready without it."""
        if self.store is None:
            await self.batcher.run(task_status=task_status)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.store.run)
            await self.batcher.run(task_status=task_status)

    # -- per request -------------------------------------------------------------------------

    async def load_items(self, items: Sequence[str]) -> list[bytes]:
        """The encoded bytes of each ``mm_items`` entry, without decoding pixels. ``http(s)``
        items are fetched (under the fetch rules), the rest loaded off the event loop (base64
        of MBs, file reads). Raises :class:`InvalidInput` naming the entry.

        Every per-request limit is checked before the work it bounds: the image count before
        anything is loaded; the bytes as each item is read or fetched (an item only gets what
        is left of ``max_request_bytes``); the pixels from each header, before any decode.
        An entry repeated in one request is loaded once."""
        limits = self.settings
        if len(items) > limits.queue_size:
            raise InvalidInput(
                f"{len(items)} images in one request; this server accepts at most "
                f"{limits.queue_size}"
            )
        first: dict[str, int] = {}
        for index, item in enumerate(items):
            first.setdefault(item, index)
        loaded: dict[str, bytes] = {}
        bytes_left, pixels = limits.max_request_bytes, 0
        for item, index in first.items():
            max_bytes = min(limits.max_image_bytes, bytes_left)
            try:
                if is_remote(item):
                    data = await self._fetcher.fetch(item, max_bytes=max_bytes)
                    pixels += await self.batcher.run_decode(partial(self._pixels, data))
                else:
                    data, more = await self.batcher.run_decode(
                        partial(self._load_local, item, max_bytes)
                    )
                    pixels += more
            except ImageTooBig as exc:
                if max_bytes < limits.max_image_bytes:  # the request's budget ran out first
                    raise InvalidInput(_request_too_big(index, limits.max_request_bytes)) from None
                raise InvalidInput(f"mm_items[{index}]: {exc.message}") from None
            except InvalidInput as exc:
                raise InvalidInput(f"mm_items[{index}]: {exc.message}") from None
            if pixels > limits.max_request_pixels:
                raise InvalidInput(
                    f"mm_items[{index}]: the request's images have more than "
                    f"{limits.max_request_pixels} pixels together (max_request_pixels)"
                )
            bytes_left -= len(data)
            loaded[item] = data
        return [loaded[item] for item in items]

    def _load_local(self, item: str, max_bytes: int) -> tuple[bytes, int]:
        """In a worker thread: a local item's bytes and its pixel count (from its header)."""
        data = load_item(item, max_bytes=max_bytes, media_dir=self.settings.media_dir)
        return data, self._pixels(data)

    def _pixels(self, data: bytes) -> int:
        return image_pixels(data, max_pixels=self.settings.max_image_pixels)

    async def encode(self, items: Sequence[bytes]) -> Embedding | RowsEmbedding | ArenaEmbedding:
        """The embedding of a request's images: ``(images * tokens, hidden)`` rows in order.

        Raises :class:`InvalidInput` (an image cannot be decoded), :class:`Overloaded` (the
        queue is full, or the encoder is not running), :class:`EncodeFailed` (the model raised)
        or :class:`ShuttingDown` (the encoder stopped while the request waited).
        """
        if not self.batcher.running:
            raise self._not_running()
        if not items:
            raise InvalidInput("mm_items is empty: send at least one image")
        if len(items) > self.settings.queue_size:
            raise InvalidInput(
                f"{len(items)} images in one request; this server accepts at most "
                f"{self.settings.queue_size}"
            )
        model_id = self.model.model_id
        keys = await self.batcher.run_decode(
            lambda: [content_key(model_id, data) for data in items]
        )
        results: list[torch.Tensor | None] = [None] * len(items)
        grids: list[Grid | None] = [None] * len(items)
        segments: list[Segment | None] = [None] * len(items)
        handed_over = False
        try:
            if self._arena is not None:
                for index, key in enumerate(keys):
                    segment = self._arena.lookup(key)
                    if segment is not None:
                        segments[index] = segment
                        results[index] = self.batcher.row_view(segment)
                        grids[index] = _grid(segment.tag)
                await self._drop_poisoned(segments, results, grids)
                misses = sum(result is None for result in results)
                self.observer.cache_looked_up(len(items) - misses, misses)
            elif self._cache is not None:
                results = [self._cache.get(key) for key in keys]
                grids = [self._cache.grid(key) for key in keys]
                await self._drop_poisoned_rows(keys, results, grids)
                misses = sum(result is None for result in results)
                self.observer.cache_looked_up(len(items) - misses, misses)
            missing = [i for i, result in enumerate(results) if result is None]
            if missing and self.store is not None:
                checksums = await self._look_up_store(keys, results, missing)
                if self._arena is not None:
                    await self._keep_store_hits(keys, results, missing, segments, checksums)
                missing = [i for i, result in enumerate(results) if result is None]
            if missing:
                await self._encode_missing(items, keys, results, grids, missing, segments)
            rows = [result for result in results if result is not None]
            if self._arena is not None and all(segment is not None for segment in segments):
                parts = [(seg, row) for seg, row in zip(segments, rows, strict=True) if seg]
                embedding = await self.batcher.run_decode(
                    partial(_checksummed, ArenaEmbedding(parts, grids))
                )
                handed_over = True  # its leases are the embedding's now
                return embedding
            if self._arena is not None:
                self._arena.fallbacks += 1
            assembled = await self.batcher.run_decode(partial(_assemble, rows, grids, segments))
            handed_over = True  # the arena leases of the rows that lie there are its now
            return assembled
        finally:
            if not handed_over:
                for segment in segments:
                    if segment is not None:
                        segment.arena.release(segment)

    async def _drop_poisoned(
        self,
        segments: list[Segment | None],
        results: list[torch.Tensor | None],
        grids: list[Grid | None],
    ) -> None:
        """Compare every arena hit's bytes with the checksum recorded when its segment was
        written, and treat a mismatch as a miss: the segment is dropped from the cache (freed
        when its leases end), counted and logged, never served. The arena is registered with
        the transfer engine for the server's life, so anyone who reaches the engine's port
        can write it; this is what keeps such a write out of later requests' answers."""
        assert self._arena is not None
        hits = list(dict.fromkeys(segment for segment in segments if segment is not None))
        if not hits:
            return
        intact = await self.batcher.run_decode(partial(_intact, hits))
        poisoned = {segment for segment, ok in zip(hits, intact, strict=True) if not ok}
        if not poisoned:
            return
        for bad in poisoned:
            self._arena.discard(bad)
        for index, held in enumerate(segments):
            if held is not None and held in poisoned:
                self._arena.release(held)
                segments[index] = None
                results[index] = None
                grids[index] = None
        self.observer.cache_poisoned(len(poisoned), "arena")
        log.warning(
            "%d cached embeddings no longer match their checksum: dropped and encoded again "
            "(something wrote into the registered arena)",
            len(poisoned),
        )

    async def _drop_poisoned_rows(
        self,
        keys: list[CacheKey],
        results: list[torch.Tensor | None],
        grids: list[Grid | None],
    ) -> None:
        """Compare every hit of the cache (without an arena) with the checksum recorded when
        its row was written, and treat a mismatch as a miss: dropped from the cache, counted,
        logged, encoded again. A cached row is registered with the transfer engine while any
        request sends it, so anyone who reaches the engine's port can write it then."""
        assert self._cache is not None
        cache = self._cache
        hits = {keys[i]: row for i, row in enumerate(results) if row is not None}
        if not hits:
            return
        expected = [cache.digest(key) for key in hits]
        found = await self.batcher.run_decode(partial(_checksums, list(hits.values())))
        poisoned = {
            key for key, want, got in zip(hits, expected, found, strict=True) if want != got
        }
        if not poisoned:
            return
        dropped = sum(cache.discard(key, hits[key]) for key in poisoned)
        for index, key in enumerate(keys):
            if key in poisoned:
                results[index] = None
                grids[index] = None
        if dropped:
            self.observer.cache_poisoned(dropped, "cache")
            self.observer.cache_size(cache.nbytes, len(cache))
        log.warning(
            "%d cached embeddings no longer match their checksum: dropped and encoded again "
            "(something wrote into a cached row while it was registered)",
            len(poisoned),
        )

    async def _keep_store_hits(
        self,
        keys: list[CacheKey],
        results: list[torch.Tensor | None],
        looked_up: list[int],
        segments: list[Segment | None],
        checksums: dict[CacheKey, str],
    ) -> None:
        """Copy each store hit into an arena segment kept as the local cache, so the request is
        sent from the arena (no registration) and the next one finds it here. A store read
        lands in memory of its own (an abandoned read may still write it), hence the copy; with
        the arena full, the hit stays where it is and the request registers its own memory.
        The segment is compared later with the checksum the store's entry was checked against,
        not one of the copy: a write into the segment meanwhile is caught, not recorded."""
        assert self._arena is not None
        assert self.model.fixed_tokens is not None
        nbytes = self.batcher.row_bytes(self.model.fixed_tokens)
        placed: dict[CacheKey, Segment] = {}
        for index in looked_up:
            row, key = results[index], keys[index]
            if row is None or segments[index] is not None:
                continue
            segment = placed.get(key)
            if segment is None:
                segment = self._arena.allocate(nbytes)
                if segment is None:
                    continue
                segments[index] = segment  # from here the caller's cleanup releases it
                view = self.batcher.row_view(segment)
                await self.batcher.run_decode(partial(_fill, segment, view, row, checksums[key]))
                kept = self._arena.keep(segment, key)
                if kept is not segment:  # another request kept this image meanwhile
                    self._arena.lease(kept)
                    self._arena.release(segment)
                    segment = kept
                placed[key] = segment
            else:
                self._arena.lease(segment)  # one lease per index, as lookups take
            segments[index] = segment
            results[index] = self.batcher.row_view(segment)

    async def _look_up_store(
        self, keys: list[CacheKey], results: list[torch.Tensor | None], missing: list[int]
    ) -> dict[CacheKey, str]:
        """Fill ``results`` from the store where it holds the image (checked against the
        checksum stored with it); the checksum of each image found. Images already queued or
        in a forward here are not looked up (joining that forward is cheaper), and an image
        another request is already reading from the store waits for that read."""
        assert self.store is not None
        own: dict[CacheKey, list[int]] = {}
        joined: dict[CacheKey, list[int]] = {}
        for index in missing:
            key = keys[index]
            if key not in self.batcher.in_flight:
                (joined if key in self._store_reads else own).setdefault(key, []).append(index)
        others = {key: self._store_reads[key] for key in joined}
        reads = {key: _StoreRead() for key in own}
        self._store_reads.update(reads)
        try:
            if reads:
                into = [self._landing_row() for _ in reads]
                fingerprint = self.model.fingerprint
                found = await self.store.get([store_key(fingerprint, k) for k in reads], into)
                # A miss's tensor may still be written by an abandoned read: it is dropped.
                for read, tensor, checksum in zip(reads.values(), into, found, strict=True):
                    read.row = tensor if checksum is not None else None
                    read.checksum = checksum
        finally:
            # Whatever happened (a cancelled caller too), those waiting on these reads go on.
            for key, read in reads.items():
                read.done.set()
                if self._store_reads.get(key) is read:
                    del self._store_reads[key]
        for read in others.values():
            await read.done.wait()  # bounded: the reading request's lookup is
        checksums: dict[CacheKey, str] = {}
        late: dict[CacheKey, list[int]] = {}
        for key, indices in [*own.items(), *joined.items()]:
            read = reads.get(key) or others[key]
            row = read.row
            if row is not None and read.checksum is not None:
                checksums[key] = read.checksum
                if self._cache is not None:
                    self._cache.put(key, row, read.checksum)
            elif self._cache is not None and key in self._cache:
                late[key] = indices  # a forward elsewhere may have finished meanwhile
                continue
            for index in indices:
                results[index] = row
        if late:  # from the cache: checked as every cache hit is
            late_keys = list(late)
            rows = [self._cache.get(key) if self._cache else None for key in late_keys]
            await self._drop_poisoned_rows(late_keys, rows, [None] * len(rows))
            for key, row in zip(late_keys, rows, strict=True):
                for index in late[key]:
                    results[index] = row
        return checksums

    def _landing_row(self) -> torch.Tensor:
        """Memory for one image's embedding read from the store: the tensor the request then
        sends from and the cache keeps, so a hit is never copied. An abandoned read may still
        write it after the lookup gave up (the store keeps it alive until then); whatever
        provides this memory must not reuse it while a reference to it remains."""
        model = self.model
        assert model.fixed_tokens is not None  # the store is refused for other models
        return torch.empty(model.fixed_tokens, model.hidden_size, dtype=model.dtype)

    async def _encode_missing(
        self,
        items: Sequence[bytes],
        keys: list[CacheKey],
        results: list[torch.Tensor | None],
        grids: list[Grid | None],
        missing: list[int],
        segments: list[Segment | None],
    ) -> None:
        in_flight = self.batcher.in_flight
        shared = [i for i in missing if keys[i] in in_flight]
        own = [i for i in missing if keys[i] not in in_flight]
        to_decode: dict[CacheKey, int] = {}  # one index per new image; duplicates share it
        for index in own:
            to_decode.setdefault(keys[index], index)
        count = len(to_decode)
        if self.queued_images + count > self.settings.queue_size:
            self.observer.rejected(count)
            raise Overloaded(
                f"the encoder queue is full ({self.queued_images} of "
                f"{self.settings.queue_size} images waiting); retry later"
            )
        request = _Request(results, grids, remaining=len(missing), segments=segments)
        try:
            # Join before decoding, so a shared job that finishes meanwhile still delivers.
            for index in shared:
                self._wait_for(in_flight[keys[index]], request, index)
            if to_decode:
                prepared = await self.batcher.decode(items, list(to_decode.values()))
                room = await self.batcher.reserve_segments([image.tokens for image in prepared])
                try:
                    # A caller cancelled while its decode thread ran learns that first; only a
                    # caller still wanted hears that the encoder stopped meanwhile.
                    await trio.lowlevel.checkpoint_if_cancelled()
                    if not self.batcher.running:
                        raise self._not_running()
                    places = zip(prepared, range(len(room)), strict=True)
                    by_key = dict(zip(to_decode, places, strict=True))
                    self._queue_jobs(request, keys, own, by_key, room)
                finally:
                    release_all(room)  # what no new job took
            await request.done.wait()
        finally:
            self._withdraw(request)
        if request.error is not None:
            raise request.error

    def _queue_jobs(
        self,
        request: _Request,
        keys: list[CacheKey],
        indices: list[int],
        prepared: dict[CacheKey, tuple[Prepared, int]],
        room: list[Segment | None],
    ) -> None:
        """Wait for each image's job, queueing one only where no request queued it meanwhile
        (while this one decoded). A new job takes its image's segment from ``room`` (by the
        position ``prepared`` gives it), leaving None there."""
        now = trio.current_time()
        for index in indices:
            job = self.batcher.in_flight.get(keys[index])
            if job is None:
                image, place = prepared[keys[index]]
                segment, room[place] = room[place], None
                job = self.batcher.submit(keys[index], image, now, segment)
            self._wait_for(job, request, index)

    @staticmethod
    def _wait_for(job: Job, request: _Request, index: int) -> None:
        job.waiters.append((request, index))
        request.jobs.add(job)

    def _withdraw(self, request: _Request) -> None:
        """The request no longer waits (done, failed or cancelled); the batcher drops what
        nobody else waits for."""
        for job in request.jobs:
            self.batcher.withdraw(job, request)
        request.jobs.clear()

    def _not_running(self) -> RequestError:
        if self.batcher.stopped:
            return ShuttingDown("the encoder has stopped")
        return NotReady("the encoder is not ready yet")


def _checksummed(embedding: ArenaEmbedding) -> ArenaEmbedding:
    """In a worker thread: compute the checksum (it reads every byte)."""
    embedding.checksum  # noqa: B018 - computed here, remembered by the embedding
    return embedding


def _grid(tag: object) -> Grid | None:
    """The grid an arena segment was tagged with (None: a fixed-grid image)."""
    if tag is None:
        return None
    if not isinstance(tag, tuple):
        raise TypeError(f"a segment's tag is a grid, got {tag!r}")
    return tuple(int(v) for v in tag)


def _intact(segments: Sequence[Segment]) -> list[bool]:
    """In a worker thread: whether each segment's bytes still match the checksum recorded
    when it was written (one without a record never matches)."""
    return [
        segment.digest is not None and checksum_of(segment.buffer) == segment.digest
        for segment in segments
    ]


def _fill(segment: Segment, view: torch.Tensor, row: torch.Tensor, checksum: str) -> None:
    """In a worker thread: copy ``row`` into ``segment`` (through ``view``) and record the
    checksum later lookups compare with: the one ``row`` was checked against."""
    view.copy_(row)
    segment.digest = checksum


def _checksums(rows: Sequence[torch.Tensor]) -> list[str]:
    """In a worker thread: the checksum of each row's bytes as they lie now."""
    return [tensor_checksum(row) for row in rows]


def _assemble(
    rows: list[torch.Tensor], grids: Sequence[Grid | None], segments: Sequence[Segment | None]
) -> Embedding | RowsEmbedding:
    """In a worker thread: the request's rows as one embedding, never concatenated (each row
    is sent as it lies, so a request naming one cached image many times copies nothing), its
    checksum computed (it reads every byte, so not on the event loop). Rows that lie in arena
    segments keep their leases in the embedding until it is released."""
    held = [segment for segment in segments if segment is not None]
    if len(rows) == 1 and not held:
        embedding: Embedding | RowsEmbedding = Embedding(
            rows[0], tuple(grids), (int(rows[0].shape[0]),)
        )
    else:
        embedding = RowsEmbedding(rows, grids, leases=held)
    embedding.checksum  # noqa: B018 - computed here, remembered by the embedding
    return embedding


def _request_too_big(index: int, limit: int) -> str:
    return (
        f"mm_items[{index}]: the request's images are more than {limit} bytes together "
        "(max_request_bytes)"
    )


def arena_for(settings: EncoderSettings) -> Arena | None:
    """The arena of ``settings.arena_bytes`` (None when 0), bounded as the cache by
    ``settings.cache_bytes``."""
    if settings.arena_bytes <= 0:
        return None
    return Arena(settings.arena_bytes, cache_bytes=settings.cache_bytes)


def pin_for_cuda(arena: Arena) -> None:
    """Page-lock the arena with CUDA, so a device-to-host copy into a segment is asynchronous
    (the forward's thread waits for it before delivering). Once per process and arena."""
    runtime: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    status = runtime.cudaHostRegister(arena.address, arena.nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of the arena ({arena.nbytes} bytes) failed: {status}")
