"""Cross-request batching: one forward pass for the queued images of many requests.

The front (:mod:`trio_encode.encoder.front`) queues a :class:`Job` for each image no forward
is computing yet; the long-lived :meth:`Batcher.run` task takes up to ``max_batch_size`` of
them (waiting at most ``max_batch_wait`` for the oldest one's batch to fill), runs the model in
a worker thread and delivers each job's row to every request waiting on it. The thread is never
abandoned: a cancelled caller waits for it, so no tensor is freed while the model writes it.

A job stays in :attr:`Batcher.in_flight`, by its image's content key, from queueing until it
delivers, so that the front can join a second request to it. Every row a forward computes is
kept where later requests look: this encoder's cache or arena, and the cluster-wide store
(offered in the background).

With a registered arena (:mod:`trio_encode.arena`) each image's row is written into a segment
of it by the forward's worker thread (the one copy): the segment its request reserved, else one
free when the batch runs; an image with neither is encoded into ordinary memory.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, TypeVar

import torch
import trio

from trio_encode.arena import Arena, Segment
from trio_encode.encoder.backend import VisionBackend
from trio_encode.encoder.cache import CacheKey, EmbeddingCache
from trio_encode.encoder.images import decode_image
from trio_encode.encoder.observer import EncoderObserver
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.store import EmbeddingStore, store_key
from trio_encode.errors import EncodeFailed, InvalidInput, RequestError, ShuttingDown

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

    def deliver(self, index: int, row: torch.Tensor, segment: Segment | None) -> None:
        """The row for image ``index``; ``segment`` (if any) is the arena's memory behind it."""

    def fail(self, error: RequestError) -> None:
        """The image will not be encoded: the request fails with ``error``."""


@dataclass(eq=False)
class Job:
    """One image waiting for (or in) a forward pass, shared by every request that needs it."""

    key: CacheKey
    pixels: torch.Tensor
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
            request.deliver(index, row, segment)

    def fail(self, error: RequestError) -> None:
        for request, _ in self.waiters:
            request.fail(error)


class Batcher:
    """The queue of jobs and the task that runs them in batches (``run()`` in the service's
    nursery). What to queue, and for whom, is the front's decision."""

    def __init__(
        self,
        backend: VisionBackend,
        settings: EncoderSettings,
        *,
        bytes_per_image: int,
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
        self._bytes_per_image = bytes_per_image
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

    async def decode(self, items: Sequence[bytes], indices: list[int]) -> list[torch.Tensor]:
        """The pixels of ``items[i]`` for each of ``indices``, decoded in a worker thread while
        their places in the queue are held, so concurrent admissions count them."""
        self._reserved += len(indices)
        try:
            return await self.run_decode(partial(self._decode, items, indices))
        finally:
            self._reserved -= len(indices)

    async def reserve_segments(self, count: int) -> list[Segment]:
        """Up to ``count`` segments for a request's new images, waiting for room while the
        arena is full, for at most :data:`ARENA_WAIT` and never past the caller's deadline
        (the request scope's backstop). Fewer when time runs out: those images go to ordinary
        memory and the request registers its own (a fallback)."""
        if self._arena is None or self._bytes_per_image > self._arena.nbytes:
            return []  # no arena, or one that can never hold an image: nothing to wait for
        deadline = min(trio.current_effective_deadline(), trio.current_time() + ARENA_WAIT)
        room: list[Segment] = []
        try:
            for _ in range(count):
                segment = await self._arena.allocate_by(self._bytes_per_image, deadline)
                if segment is None:
                    break
                room.append(segment)
        except BaseException:
            release_all(room)
            raise
        return room

    def submit(
        self, key: CacheKey, pixels: torch.Tensor, enqueued_at: float, segment: Segment | None
    ) -> Job:
        """Queue a job for an image no job is computing (``segment``: its reserved room)."""
        job = Job(key, pixels, enqueued_at)
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
        return flat.view(backend.dtype).view(backend.tokens_per_image, backend.hidden_size)

    def _forget(self, job: Job) -> None:
        """Drop the job from the in-flight map (unless a newer job for its image took its place)."""
        if self._in_flight.get(job.key) is job:
            del self._in_flight[job.key]

    def _decode(self, items: Sequence[bytes], indices: list[int]) -> list[torch.Tensor]:
        pixels = []
        for index in indices:
            try:
                pixels.append(
                    decode_image(
                        items[index],
                        self.backend.preprocess,
                        max_pixels=self.settings.max_image_pixels,
                    )
                )
            except InvalidInput as exc:
                raise InvalidInput(f"mm_items[{index}]: {exc.message}") from None
        return pixels

    # -- the batching task -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve batches until cancelled. Reports started (and ``running``) after a warm-up
        forward pass; on exit, every request still waiting gets :class:`ShuttingDown`."""
        if self._running:
            raise RuntimeError("ImageEncoder.run is already running")
        if self.settings.warmup:
            side = self.backend.preprocess.image_size
            blank = [torch.zeros(3, side, side)]
            await self._run_forward(partial(self._forward, blank))
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

    async def _next_batch(self) -> list[Job]:
        limit = self.settings.max_batch_size
        while True:
            while not self._queue:
                await self._wait_for_change()
            # The oldest image's wait bounds the batch window, so images that queued while
            # the previous batch ran do not wait again.
            deadline = self._queue[0].enqueued_at + self.settings.max_batch_wait
            while self._queue and len(self._queue) < limit and trio.current_time() < deadline:
                with trio.move_on_at(deadline):
                    await self._wait_for_change()
            if not self._queue:
                continue  # every queued caller was cancelled during the window
            now = trio.current_time()
            batch = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
            for job in batch:
                job.queued = False
                self.observer.queue_waited(now - job.enqueued_at)
            return batch

    async def _wait_for_change(self) -> None:
        self._changed = trio.Event()
        await self._changed.wait()

    async def _process(self, batch: list[Job]) -> None:
        pixels = [job.pixels for job in batch]
        targets = self._allocate_segments(batch)
        try:
            rows, seconds = await self._run_forward(partial(self._forward, pixels, targets))
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
        for job, row, segment in zip(batch, rows, targets, strict=True):
            self._forget(job)
            if self._cache is not None:
                self._cache.put(job.key, row)
            if self._store is not None:
                self._offer(job.key, row, segment)
            if segment is not None:
                segment.arena.keep(segment, job.key)
            job.deliver(row, segment)
        release_all(targets)  # the forward's own leases; the waiters hold theirs
        if self._cache is not None:
            self.observer.cache_size(self._cache.nbytes, len(self._cache))
        elif self._arena is not None:
            self.observer.cache_size(self._arena.cached_bytes, len(self._arena))

    def _offer(self, key: CacheKey, row: torch.Tensor, segment: Segment | None) -> None:
        """Offer a row to the store. The put reads it later, in the background: a row in the
        arena is a view of its segment, so the put holds a lease on the segment until it no
        longer reads it (an abandoned put too). Without it the segment could be evicted and
        refilled meanwhile, and the store would keep another image's bytes under this key."""
        assert self._store is not None
        done = None
        if segment is not None:
            segment.arena.lease(segment)
            done = partial(segment.arena.release, segment)
        self._store.put(store_key(self.backend.fingerprint, key), row, done)

    def _allocate_segments(self, batch: list[Job]) -> list[Segment | None]:
        """A segment for each image of a batch, leased by the forward until it delivers: the
        one its job reserved, else one free now; None where there is none (ordinary memory)."""
        targets: list[Segment | None] = []
        for job in batch:
            segment, job.segment = job.segment, None
            if segment is None and self._arena is not None:
                segment = self._arena.allocate(self._bytes_per_image)
            targets.append(segment)
        return targets

    def _forward(
        self, pixels: list[torch.Tensor], targets: Sequence[Segment | None] = ()
    ) -> tuple[list[torch.Tensor], float]:
        """In the worker thread: one forward pass, split into one tensor per image; an image
        with a target segment is copied into it (its row is then a view of the segment)."""
        start = time.perf_counter()
        backend = self.backend
        with torch.inference_mode():
            out = backend.forward(torch.stack(pixels))
            expected = (len(pixels), backend.tokens_per_image, backend.hidden_size)
            if tuple(out.shape) != expected or out.dtype != backend.dtype:
                raise RuntimeError(
                    f"the model returned {tuple(out.shape)} {out.dtype}, "
                    f"expected {expected} {backend.dtype}"
                )
            out = out.contiguous()
            # With a cache each image gets its own memory, so the cache's byte bound is exact
            # and evicting an entry frees it; without one, rows are views into the batch.
            own = self._cache is not None or self._arena is not None
            rows = []
            for index, row in enumerate(out):
                segment = targets[index] if targets else None
                if segment is not None:
                    rows.append(self.row_view(segment).copy_(row))
                else:
                    rows.append(row.clone() if own else row)
        return rows, time.perf_counter() - start

    async def _decode_in_thread(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn, limiter=self._decode_limiter)

    async def _forward_in_thread(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn, limiter=self._forward_limiter)


def release_all(segments: Sequence[Segment | None]) -> None:
    """Give back the lease held on each segment (None: no segment, nothing to give back)."""
    for segment in segments:
        if segment is not None:
            segment.arena.release(segment)
