"""Cross-request batching: one forward pass for the queued images of many requests.

The front (:mod:`trio_encode.encoder.front`) queues a :class:`Job` for each image no forward
is computing yet; the long-lived :meth:`Batcher.run` task takes up to ``max_batch_size`` of
them, and at most ``max_batch_tokens`` image tokens (waiting at most ``max_batch_wait`` for the
oldest one's batch to fill), runs the model in a worker thread and delivers each job's row to
every request waiting on it. Images of different sizes share a forward; the model returns one
tensor per image, so nothing is padded and nothing is split by guesswork. The thread is never
abandoned: a cancelled caller waits for it, so no tensor is freed while the model writes it.

A job stays in :attr:`Batcher.in_flight`, by its image's content key, from queueing until it
delivers, so that the front can join a second request to it. Every row a forward computes is
kept where later requests look: this encoder's cache or arena, and the cluster-wide store
(offered in the background).

With a registered arena (:mod:`trio_encode.arena`) each image's row is written into a segment
of it by the forward's worker thread (the one copy): the segment its request reserved, else one
free when the batch runs; an image with neither is encoded into ordinary memory. On a GPU the
copy into the segment is asynchronous (the arena is pinned), and the forward's thread waits for
it before any request sees the row, so no send can read a half-copied segment.
"""

from __future__ import annotations

import io
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, TypeVar

import torch
import trio
from PIL import Image

from trio_encode.arena import Arena, Segment
from trio_encode.embedding import checksum_of, tensor_checksum
from trio_encode.encoder.backend import Prepared, VisionModel
from trio_encode.encoder.cache import CacheKey, EmbeddingCache
from trio_encode.encoder.observer import EncoderObserver
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.store import EmbeddingStore, store_key
from trio_encode.errors import EncodeFailed, InvalidInput, RequestError, ShuttingDown
from trio_encode.request_types import Grid

log = logging.getLogger(__name__)

T = TypeVar("T")

ARENA_WAIT = 0.5
"""Seconds a request waits for arena room for its new images (never past its deadline)
before they go to ordinary memory and the request registers its own embedding."""


class ThreadRunner(Protocol):
    """Runs a blocking function off the event loop (``trio.to_thread.run_sync`` by default;
    tests inject one that runs inline, to keep real threads off the mock clock)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


class Waiter(Protocol):
    """What a job delivers to: one request's rows, each at its index in the request."""

    def deliver(
        self, index: int, row: torch.Tensor, grid: Grid | None, segment: Segment | None
    ) -> None:
        """The row for image ``index`` and its grid; ``segment`` (if any) is the arena's memory
        behind it."""

    def fail(self, error: RequestError) -> None:
        """The image will not be encoded: the request fails with ``error``."""


@dataclass(eq=False)
class Job:
    """One image waiting for (or in) a forward pass, shared by every request that needs it."""

    key: CacheKey
    image: Prepared
    enqueued_at: float
    waiters: list[tuple[Waiter, int]] = field(default_factory=list)  # (request, its index)
    queued: bool = True
    segment: Segment | None = None
    """The arena segment reserved for its row (the job holds one lease until it delivers)."""

    def drop_segment(self) -> None:
        """Give the reserved segment back (the job will not run, or has delivered)."""
        segment, self.segment = self.segment, None
        if segment is not None:
            segment.arena.release(segment)

    def deliver(self, row: torch.Tensor, segment: Segment | None) -> None:
        for request, index in self.waiters:
            request.deliver(index, row, self.image.grid, segment)

    def fail(self, error: RequestError) -> None:
        for request, _ in self.waiters:
            request.fail(error)


class Batcher:
    """The queue of jobs and the task that runs them in batches (``run()`` in the service's
    nursery). What to queue, and for whom, is the front's decision."""

    def __init__(
        self,
        backend: VisionModel,
        settings: EncoderSettings,
        *,
        observer: EncoderObserver,
        cache: EmbeddingCache | None,
        arena: Arena | None,
        store: EmbeddingStore | None,
        run_decode: ThreadRunner | None = None,
        run_forward: ThreadRunner | None = None,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.observer = observer
        self._row_bytes = backend.hidden_size * backend.dtype.itemsize
        """Bytes of one token's embedding row."""
        self._cache = cache
        self._arena = arena
        self._store = store
        # Decoding gets its own small thread pool so a burst of big images cannot take every
        # core from the forward pass.
        self._decode_limiter = trio.CapacityLimiter(2)
        # The forward has threads of its own: it must never wait behind transfers or decodes.
        self._forward_limiter = trio.CapacityLimiter(1)
        self.run_decode: ThreadRunner = run_decode or self._decode_in_thread
        """Runs a request's blocking work other than the forward (decoding, hashing, copies)."""
        self._run_forward: ThreadRunner = run_forward or self._forward_in_thread
        self._queue: deque[Job] = deque()
        self._in_flight: dict[CacheKey, Job] = {}
        self._reserved = 0  # images admitted and still being decoded
        self._changed = trio.Event()
        self._running = False
        self._stopped = False

    @property
    def running(self) -> bool:
        """True while :meth:`run` is serving batches (after its warm-up forward)."""
        return self._running

    @property
    def stopped(self) -> bool:
        """True once :meth:`run` has ended (until it runs again)."""
        return self._stopped

    @property
    def queued_images(self) -> int:
        """Images waiting for a forward pass, including those still being decoded."""
        return len(self._queue) + self._reserved

    @property
    def in_flight(self) -> Mapping[CacheKey, Job]:
        """Every queued or running job by its image: a request needing the same image joins
        it instead of encoding it again."""
        return self._in_flight

    # -- queueing ----------------------------------------------------------------------------

    async def decode(self, items: Sequence[bytes], indices: list[int]) -> list[Prepared]:
        """``items[i]`` prepared for the model, for each of ``indices``, decoded in a worker
        thread while their places in the queue are held, so concurrent admissions count them."""
        self._reserved += len(indices)
        try:
            # One image per thread call: the decode threads' limiter is first come, first
            # served, so concurrent requests take turns image by image and a request of many
            # large images cannot hold the threads while another's single image waits.
            pixels = []
            for index in indices:
                pixels += await self.run_decode(partial(self._decode, items, [index]))
            return pixels
        finally:
            self._reserved -= len(indices)

    def row_bytes(self, tokens: int) -> int:
        """Bytes of an image's embedding of ``tokens`` rows."""
        return tokens * self._row_bytes

    async def reserve_segments(self, tokens: Sequence[int]) -> list[Segment | None]:
        """A segment for each of a request's new images (of ``tokens`` rows each), waiting for
        room while the arena is full, for at most :data:`ARENA_WAIT` and never past the
        caller's deadline (the request scope's backstop). None where time ran out, or for an
        image bigger than the arena: those go to ordinary memory and the request registers its
        own (a fallback)."""
        if self._arena is None:
            return [None] * len(tokens)
        deadline = min(trio.current_effective_deadline(), trio.current_time() + ARENA_WAIT)
        room: list[Segment | None] = []
        try:
            for count in tokens:
                nbytes = self.row_bytes(count)
                segment = None
                if nbytes <= self._arena.nbytes and trio.current_time() < deadline:
                    segment = await self._arena.allocate_by(nbytes, deadline)
                room.append(segment)
        except BaseException:
            release_all(room)
            raise
        return room

    def submit(
        self, key: CacheKey, image: Prepared, enqueued_at: float, segment: Segment | None
    ) -> Job:
        """Queue a job for an image no job is computing (``segment``: its reserved room)."""
        job = Job(key, image, enqueued_at)
        job.segment = segment
        self._in_flight[job.key] = job
        self._queue.append(job)
        self._changed.set()
        return job

    def withdraw(self, job: Job, waiter: Waiter) -> None:
        """``waiter`` no longer waits for ``job``. A queued job nobody waits for any more
        leaves the queue: it is never encoded for nobody."""
        job.waiters = [(r, i) for r, i in job.waiters if r is not waiter]
        if job.queued and not job.waiters:
            self._queue.remove(job)
            job.queued = False
            job.drop_segment()
            self._forget(job)

    def row_view(self, segment: Segment) -> torch.Tensor:
        """An image's ``(tokens, hidden)`` row as a view of its segment's bytes."""
        backend = self.backend
        flat = torch.frombuffer(segment.buffer, dtype=torch.uint8)
        return flat.view(backend.dtype).view(-1, backend.hidden_size)

    def _forget(self, job: Job) -> None:
        """Drop the job from the in-flight map (unless a newer job for its image took its place)."""
        if self._in_flight.get(job.key) is job:
            del self._in_flight[job.key]

    def _decode(self, items: Sequence[bytes], indices: list[int]) -> list[Prepared]:
        prepared = []
        for index in indices:
            try:
                prepared.append(
                    self.backend.decode(items[index], max_pixels=self.settings.max_image_pixels)
                )
            except InvalidInput as exc:
                raise InvalidInput(f"mm_items[{index}]: {exc.message}") from None
        return prepared

    # -- the batching task -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve batches until cancelled. Reports started (and ``running``) after a warm-up
        forward pass; on exit, every request still waiting gets :class:`ShuttingDown`."""
        if self._running:
            raise RuntimeError("ImageEncoder.run is already running")
        if self.settings.warmup:
            blank = await self.run_decode(self._warmup_image)
            await self._run_forward(partial(self._forward, [blank]))
        self._stopped = False
        self._running = True
        task_status.started()
        try:
            while True:
                batch = await self._next_batch()
                await self._process(batch)
        finally:
            self._running = False
            self._stopped = True
            while self._queue:
                job = self._queue.popleft()
                job.queued = False
                job.drop_segment()
                self._forget(job)
                job.fail(ShuttingDown("the encoder stopped before this request ran"))

    def _warmup_image(self) -> Prepared:
        """A blank 224 px PNG, prepared as a request's image would be."""
        png = io.BytesIO()
        Image.new("RGB", (224, 224)).save(png, format="PNG")
        return self.backend.decode(png.getvalue(), max_pixels=self.settings.max_image_pixels)

    def _batch_full(self) -> bool:
        """Whether the queue holds at least a whole batch (by images, or by tokens)."""
        if len(self._queue) >= self.settings.max_batch_size:
            return True
        budget = self.settings.max_batch_tokens
        return budget is not None and sum(job.image.tokens for job in self._queue) >= budget

    def _take_batch(self) -> list[Job]:
        """The oldest jobs, in order, up to the image count and the token budget (at least
        one job, whatever its size)."""
        budget = self.settings.max_batch_tokens
        batch = [self._queue.popleft()]
        tokens = batch[0].image.tokens
        while self._queue and len(batch) < self.settings.max_batch_size:
            more = self._queue[0].image.tokens
            if budget is not None and tokens + more > budget:
                break
            batch.append(self._queue.popleft())
            tokens += more
        return batch

    async def _next_batch(self) -> list[Job]:
        while True:
            while not self._queue:
                await self._wait_for_change()
            # The oldest image's wait bounds the batch window, so images that queued while
            # the previous batch ran do not wait again.
            deadline = self._queue[0].enqueued_at + self.settings.max_batch_wait
            while self._queue and not self._batch_full() and trio.current_time() < deadline:
                with trio.move_on_at(deadline):
                    await self._wait_for_change()
            if not self._queue:
                continue  # every queued caller was cancelled during the window
            now = trio.current_time()
            batch = self._take_batch()
            for job in batch:
                job.queued = False
                self.observer.queue_waited(now - job.enqueued_at)
            return batch

    async def _wait_for_change(self) -> None:
        self._changed = trio.Event()
        await self._changed.wait()

    async def _process(self, batch: list[Job]) -> None:
        images = [job.image for job in batch]
        targets = self._allocate_segments(batch)
        try:
            rows, checksums, seconds = await self._run_forward(
                partial(self._forward, images, targets)
            )
        except Exception as exc:
            release_all(targets)
            self.observer.batch_finished(len(batch), 0.0, ok=False)
            log.exception("vision encoder failed on a batch of %d images", len(batch))
            for job in batch:
                self._forget(job)
                job.fail(
                    EncodeFailed(
                        f"the vision encoder failed on a batch of {len(batch)} images: "
                        f"{type(exc).__name__}: {exc}"
                    )
                )
            return
        except BaseException:
            release_all(targets)
            for job in batch:
                self._forget(job)
                job.fail(ShuttingDown("the encoder stopped while this request ran"))
            raise
        self.observer.batch_finished(len(batch), seconds, ok=True)
        for job, row, segment, checksum in zip(batch, rows, targets, checksums, strict=True):
            self._forget(job)
            if self._cache is not None:
                assert checksum is not None
                self._cache.put(job.key, row, checksum, job.image.grid)
            if self._store is not None:
                assert checksum is not None
                self._offer(job.key, row, segment, checksum)
            if segment is not None:
                segment.tag = job.image.grid
                segment.arena.keep(segment, job.key)
            job.deliver(row, segment)
        release_all(targets)  # the forward's own leases; the waiters hold theirs
        if self._cache is not None:
            self.observer.cache_size(self._cache.nbytes, len(self._cache))
        elif self._arena is not None:
            self.observer.cache_size(self._arena.cached_bytes, len(self._arena))

    def _offer(
        self, key: CacheKey, row: torch.Tensor, segment: Segment | None, checksum: str
    ) -> None:
        """Offer a row to the store. The put reads it later, in the background: a row in the
        arena is a view of its segment, so the put holds a lease on the segment until it no
        longer reads it (an abandoned put too). Without it the segment could be evicted and
        refilled meanwhile, and the store would keep another image's bytes under this key."""
        assert self._store is not None
        done = None
        if segment is not None:
            segment.arena.lease(segment)
            done = partial(segment.arena.release, segment)
        self._store.put(store_key(self.backend.fingerprint, key), row, checksum, done)

    def _allocate_segments(self, batch: list[Job]) -> list[Segment | None]:
        """A segment for each image of a batch, leased by the forward until it delivers: the
        one its job reserved, else one free now; None where there is none (ordinary memory)."""
        targets: list[Segment | None] = []
        for job in batch:
            segment, job.segment = job.segment, None
            nbytes = self.row_bytes(job.image.tokens)
            if segment is None and self._arena is not None and nbytes <= self._arena.nbytes:
                segment = self._arena.allocate(nbytes)
            targets.append(segment)
        return targets

    def _forward(
        self, images: list[Prepared], targets: Sequence[Segment | None] = ()
    ) -> tuple[list[torch.Tensor], list[str | None], float]:
        """In the worker thread: one forward pass, one tensor per image, in host memory; an
        image with a target segment is copied into it (its row is then a view of the segment).
        Every copy has completed when this returns. With each row, the checksum of its bytes as
        written here, for whatever keeps it (the cache, the arena, the store) to compare later
        reads with (None where nothing keeps it)."""
        start = time.perf_counter()
        backend = self.backend
        with torch.inference_mode():
            outs = backend.encode(images)
            if len(outs) != len(images):
                raise RuntimeError(f"the model returned {len(outs)} embeddings for {len(images)}")
            for out, image in zip(outs, images, strict=True):
                expected = (image.tokens, backend.hidden_size)
                if tuple(out.shape) != expected or out.dtype != backend.dtype:
                    raise RuntimeError(
                        f"the model returned {tuple(out.shape)} {out.dtype} for an image, "
                        f"expected {expected} {backend.dtype}"
                    )
            # With a cache each image gets its own memory, so the cache's byte bound is exact
            # and evicting an entry frees it; without one, rows may be views into the batch.
            own = self._cache is not None or self._arena is not None
            on_host = backend.device.type == "cpu"
            rows = []
            for index, out in enumerate(outs):
                segment = targets[index] if targets else None
                if segment is not None:
                    # From a GPU: asynchronous into the pinned arena, waited for below.
                    rows.append(self.row_view(segment).copy_(out, non_blocking=not on_host))
                elif on_host:
                    rows.append(out.clone() if own else out.contiguous())
                else:
                    rows.append(out.to("cpu"))
            if not on_host:
                torch.cuda.synchronize(backend.device)
            kept = self._cache is not None or self._store is not None
            checksums: list[str | None] = []
            for index, row in enumerate(rows):
                segment = targets[index] if targets else None
                if segment is not None:  # what later requests compare the bytes with
                    segment.digest = checksum_of(segment.buffer)
                    checksums.append(segment.digest)
                else:
                    checksums.append(tensor_checksum(row) if kept else None)
        return rows, checksums, time.perf_counter() - start

    async def _decode_in_thread(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn, limiter=self._decode_limiter)

    async def _forward_in_thread(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn, limiter=self._forward_limiter)


def release_all(segments: Sequence[Segment | None]) -> None:
    """Give back the lease held on each segment (None: no segment, nothing to give back)."""
    for segment in segments:
        if segment is not None:
            segment.arena.release(segment)
