"""Cross-request batching: one forward pass for the queued images of many requests.

The front (:mod:`trio_encode.encoder.front`) hands :meth:`Batcher.encode` the images of a
request that no level of the keeper (:mod:`trio_encode.encoder.keeping`) holds. An image no
forward is computing yet is decoded and queued as a :class:`Job`; one already queued or in a
forward is joined, so a second request waits for the same job and gets the same row. The
long-lived :meth:`Batcher.run` task takes up to ``max_batch_size`` jobs, and at most
``max_batch_tokens`` image tokens (waiting at most ``max_batch_wait`` for the oldest one's batch
to fill), runs the model in a worker thread, writes each row through the keeper once and
delivers it to every request waiting on it. Images of different sizes share a forward; the
model returns one tensor per image, so nothing is padded and nothing is split by guesswork.
The thread is never abandoned: a cancelled caller waits for it, so no tensor is freed while
the model writes it.

A caller cancelled while its images are still queued takes them out of the queue unless another
request still waits for them (they are never encoded for nobody); one cancelled while its batch
runs simply does not receive the result.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar, cast

import numpy as np
import torch
import trio
from PIL import Image

from trio_encode.arena import Segment
from trio_encode.embedding import tensor_checksum
from trio_encode.encoder.audio import (
    AudioLimits,
    DecodedAudio,
    check_audio_header,
    decode_audio,
)
from trio_encode.encoder.backend import Prepared, VisionModel
from trio_encode.encoder.cache import CacheKey
from trio_encode.encoder.keeping import (
    EmbeddingKeeper,
    Kept,
    ThreadRunner,
    release_segments,
    worker_threads,
)
from trio_encode.encoder.observer import EncoderObserver
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.video import VideoLimits, check_header, decode_video
from trio_encode.encoder.vlm_audio import AudioPath, PreparedAudio
from trio_encode.encoder.vlm_video import PreparedVideo, VideoPath
from trio_encode.errors import (
    EncodeFailed,
    InvalidInput,
    NotReady,
    Overloaded,
    RequestError,
    ShuttingDown,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Wanted:
    """One request's images that go to the forward, and where their rows go."""

    rows: list[Kept | None]
    """The request's rows by image; the ones still wanted are None until delivered."""
    remaining: int
    done: trio.Event = field(default_factory=trio.Event)
    error: RequestError | None = None
    jobs: set[Job] = field(default_factory=set)  # what it waits on, to withdraw from

    def deliver(self, index: int, kept: Kept) -> None:
        if not self.done.is_set():
            if kept.segment is not None:
                kept.segment.arena.lease(kept.segment)  # the request's own, given back with it
            self.rows[index] = kept
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()

    def fail(self, error: RequestError) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


@dataclass(eq=False)
class Job:
    """One image waiting for (or in) a forward pass, shared by every request that needs it."""

    key: CacheKey
    image: Prepared
    enqueued_at: float
    waiters: list[tuple[_Wanted, int]] = field(default_factory=list)  # (request, its index)
    queued: bool = True
    segment: Segment | None = None
    """The arena segment reserved for its row (the job holds one lease until it delivers)."""

    def drop_segment(self) -> None:
        """Give the reserved segment back (the job will not run, or has delivered)."""
        segment, self.segment = self.segment, None
        release_segments([segment])

    def deliver(self, kept: Kept) -> None:
        for request, index in self.waiters:
            request.deliver(index, kept)

    def fail(self, error: RequestError) -> None:
        for request, _ in self.waiters:
            request.fail(error)


class Batcher:
    """The queue of jobs and the task that runs them in batches (``run()`` in the service's
    nursery)."""

    def __init__(
        self,
        model: VisionModel,
        settings: EncoderSettings,
        *,
        observer: EncoderObserver,
        keeper: EmbeddingKeeper,
        in_worker_thread: ThreadRunner,
        run_forward: ThreadRunner | None = None,
        video: VideoPath | None = None,
        audio: AudioPath | None = None,
        images: bool = True,
        run_media_decode: ThreadRunner | None = None,
    ) -> None:
        self.model = model
        self.images = images
        """Whether the model takes images (an audio model's does not)."""
        self.video = video
        """The model's video path (None: the model encodes no videos)."""
        self.audio = audio
        """The model's audio path (None: the model encodes no audio)."""
        self.video_limits = VideoLimits.from_settings(settings)
        """What one video may cost to decode (the settings' ``video_*`` limits)."""
        self.audio_limits = AudioLimits.from_settings(settings)
        """What one audio clip may cost to decode (the settings' ``audio_*`` limits)."""
        self.settings = settings
        self.observer = observer
        self.keeper = keeper
        self.in_worker_thread = in_worker_thread
        """Runs a request's decode (one image a call) in the worker threads."""
        self.in_media_thread = run_media_decode or worker_threads(settings.media_decode_threads)
        """Runs a video's or an audio clip's decode (one a call) in threads of its own: a
        video may hold one for seconds, and the images of other requests must not wait
        behind it."""
        # The forward has threads of its own: it must never wait behind transfers or decodes.
        self._forward_limiter = trio.CapacityLimiter(1)
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
    def queued_images(self) -> int:
        """Images waiting for a forward pass, including those still being decoded."""
        return len(self._queue) + self._reserved

    @property
    def in_flight(self) -> Mapping[CacheKey, Job]:
        """Every queued or running job by its image: a request needing the same image joins
        it instead of encoding it again."""
        return self._in_flight

    def refusal(self) -> RequestError:
        """What a request gets while :meth:`run` is not serving: not started yet, or stopped."""
        if self._stopped:
            return ShuttingDown("the encoder has stopped")
        return NotReady("the encoder is not ready yet")

    # -- a request's images ----------------------------------------------------------------------

    async def encode(
        self,
        items: Sequence[bytes],
        keys: Sequence[CacheKey],
        missing: Sequence[int],
        rows: list[Kept | None],
        *,
        modality: str = "IMAGE",
    ) -> None:
        """Fill ``rows[i]`` for each of ``missing`` with ``items[i]``'s row (one lease each on
        a segment, the caller's to give back): joining the job of an image already queued or
        in a forward, queueing one for each other image. ``modality``: SGLang's name of what
        the items are (the model must have that modality's path). Raises :class:`Overloaded`
        when the queue has no room for the new items, :class:`InvalidInput` when one cannot be
        decoded, or what the forward failed with."""
        shared = [i for i in missing if keys[i] in self._in_flight]
        own = [i for i in missing if keys[i] not in self._in_flight]
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
        request = _Wanted(rows, remaining=len(missing))
        try:
            # Join before decoding, so a shared job that finishes meanwhile still delivers.
            for index in shared:
                _wait_for(self._in_flight[keys[index]], request, index)
            if to_decode:
                prepared = await self._decode(items, list(to_decode.values()), modality)
                room = await self.keeper.reserve([image.tokens for image in prepared])
                try:
                    # A caller cancelled while its decode thread ran learns that first; only a
                    # caller still wanted hears that the encoder stopped meanwhile.
                    await trio.lowlevel.checkpoint_if_cancelled()
                    if not self._running:
                        raise self.refusal()
                    places = zip(prepared, range(len(room)), strict=True)
                    by_key = dict(zip(to_decode, places, strict=True))
                    self._queue_jobs(request, keys, own, by_key, room)
                finally:
                    release_segments(room)  # what no new job took
            await request.done.wait()
        finally:
            for job in request.jobs:
                self._withdraw(job, request)
            request.jobs.clear()
        if request.error is not None:
            raise request.error

    async def _decode(
        self, items: Sequence[bytes], indices: list[int], modality: str = "IMAGE"
    ) -> list[Prepared]:
        """``items[i]`` prepared for the model, for each of ``indices``, decoded in a worker
        thread (a media thread for a video or an audio clip) while their places in the queue
        are held, so concurrent admissions count them."""
        self._reserved += len(indices)
        run = self.in_worker_thread if modality == "IMAGE" else self.in_media_thread
        try:
            if modality != "IMAGE":  # what the headers refuse is refused now, not after queued ones
                for index in indices:
                    await self.in_worker_thread(
                        partial(self._check_header, items[index], index, modality)
                    )
            # One image per thread call: the worker threads' limiter is first come, first
            # served, so concurrent requests take turns image by image and a request of many
            # large images cannot hold the threads while another's single image waits.
            return [
                await run(partial(self._decode_one, items[index], index, modality))
                for index in indices
            ]
        finally:
            self._reserved -= len(indices)

    def _check_header(self, data: bytes, index: int, modality: str) -> None:
        """In a worker thread: refuse a video or an audio clip by its container's header (no
        packet read)."""
        try:
            if modality == "VIDEO":
                check_header(data, self.video_limits)
            else:
                assert self.audio is not None
                check_audio_header(data, self.audio.sampling_rate, self.audio_limits)
        except InvalidInput as exc:  # its own class: a clip over a limit stays a 413
            raise type(exc)(f"mm_items[{index}]: {exc.message}") from None

    def _decode_one(self, data: bytes, index: int, modality: str = "IMAGE") -> Prepared:
        """In a worker thread: one image, video or audio clip prepared for the model (the
        front admits a modality only with its path)."""
        try:
            if modality == "VIDEO":
                assert self.video is not None
                decoded = decode_video(data, self.video.sampling, self.video_limits)
                return self.video.prepare(decoded)
            if modality == "AUDIO":
                assert self.audio is not None
                clip = decode_audio(data, self.audio.sampling_rate, self.audio_limits)
                return self.audio.prepare(clip)
            return self.model.decode(data, max_pixels=self.settings.max_image_pixels)
        except InvalidInput as exc:  # its own class: a video over a limit stays a 413
            raise type(exc)(f"mm_items[{index}]: {exc.message}") from None

    def _queue_jobs(
        self,
        request: _Wanted,
        keys: Sequence[CacheKey],
        indices: list[int],
        prepared: dict[CacheKey, tuple[Prepared, int]],
        room: list[Segment | None],
    ) -> None:
        """Wait for each image's job, queueing one only where no request queued it meanwhile
        (while this one decoded). A new job takes its image's segment from ``room`` (by the
        position ``prepared`` gives it), leaving None there."""
        now = trio.current_time()
        for index in indices:
            job = self._in_flight.get(keys[index])
            if job is None:
                image, place = prepared[keys[index]]
                job = Job(keys[index], image, now, segment=room[place])
                room[place] = None
                self._in_flight[job.key] = job
                self._queue.append(job)
                self._changed.set()
            _wait_for(job, request, index)

    def _withdraw(self, job: Job, request: _Wanted) -> None:
        """``request`` no longer waits for ``job`` (done, failed or cancelled). A queued job
        nobody waits for any more leaves the queue: it is never encoded for nobody."""
        job.waiters = [(r, i) for r, i in job.waiters if r is not request]
        if job.queued and not job.waiters:
            self._queue.remove(job)
            job.queued = False
            job.drop_segment()
            self._forget(job)

    def _forget(self, job: Job) -> None:
        """Drop the job from the in-flight map (unless a newer job for its image took its place)."""
        if self._in_flight.get(job.key) is job:
            del self._in_flight[job.key]

    # -- the batching task -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve batches until cancelled. Reports started (and ``running``) after a warm-up
        forward pass; on exit, every request still waiting gets :class:`ShuttingDown`."""
        if self._running:
            raise RuntimeError("Batcher.run is already running")
        if self.settings.warmup:
            blank = await self.in_worker_thread(self._warmup_item)
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

    def _warmup_item(self) -> Prepared:
        """A blank 224 px PNG, prepared as a request's image would be; for a model that takes
        no images, a second of silence prepared as an audio clip."""
        if not self.images and self.audio is not None:
            rate = self.audio.sampling_rate
            silence = DecodedAudio(np.zeros(rate, dtype=np.float32), rate, "pcm_f32le", rate, 1)
            return self.audio.prepare(silence)
        png = io.BytesIO()
        Image.new("RGB", (224, 224)).save(png, format="PNG")
        return self.model.decode(png.getvalue(), max_pixels=self.settings.max_image_pixels)

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
            release_segments(targets)
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
            release_segments(targets)
            for job in batch:
                self._forget(job)
                job.fail(ShuttingDown("the encoder stopped while this request ran"))
            raise
        self.observer.batch_finished(len(batch), seconds, ok=True)
        for job, row, segment, checksum in zip(batch, rows, targets, checksums, strict=True):
            self._forget(job)
            kept = Kept(row, job.image.grid, checksum, segment, job.image.meta)
            self.keeper.keep(job.key, kept)  # with its metadata: a hit answers as this did
            job.deliver(kept)
        release_segments(targets)  # the forward's own leases; the waiters hold theirs
        self.keeper.report_size()

    def _allocate_segments(self, batch: list[Job]) -> list[Segment | None]:
        """A segment for each image of a batch, leased by the forward until it delivers: the
        one its job reserved, else one free now; None where there is none (ordinary memory)."""
        targets: list[Segment | None] = []
        for job in batch:
            segment, job.segment = job.segment, None
            targets.append(segment or self.keeper.room_now(job.image.tokens))
        return targets

    def _forward(
        self, images: list[Prepared], targets: Sequence[Segment | None] = ()
    ) -> tuple[list[torch.Tensor], list[str | None], float]:
        """In the worker thread: one forward pass, one tensor per image, in host memory; an
        image with a target segment is copied into it (its row is then a view of the segment).
        Every copy has completed when this returns. With each row, the checksum of its bytes as
        written here, for whatever keeps it (the arena, plain memory, the store) to compare
        later reads with (None where nothing keeps it)."""
        start = time.perf_counter()
        model, keeper = self.model, self.keeper
        with torch.inference_mode():
            outs = self._encode(images)
            if len(outs) != len(images):
                raise RuntimeError(f"the model returned {len(outs)} embeddings for {len(images)}")
            for out, image in zip(outs, images, strict=True):
                expected = (image.tokens, model.hidden_size)
                if tuple(out.shape) != expected or out.dtype != model.dtype:
                    raise RuntimeError(
                        f"the model returned {tuple(out.shape)} {out.dtype} for an image, "
                        f"expected {expected} {model.dtype}"
                    )
            # With a local level each image gets its own memory, so the cache's byte bound is
            # exact and evicting an entry frees it; without one, rows may be views into the batch.
            own = keeper.local is not None
            on_host = model.device.type == "cpu"
            rows = []
            for index, out in enumerate(outs):
                segment = targets[index] if targets else None
                if segment is not None:
                    # From a GPU: asynchronous into the pinned arena, waited for below.
                    rows.append(keeper.row_view(segment).copy_(out, non_blocking=not on_host))
                elif on_host:
                    rows.append(out.clone() if own else out.contiguous())
                else:
                    rows.append(out.to("cpu"))
            if not on_host:
                torch.cuda.synchronize(model.device)
            checksums: list[str | None] = []
            for index, row in enumerate(rows):
                in_arena = bool(targets) and targets[index] is not None
                if in_arena or keeper.checksums_rows_outside_the_arena:
                    checksums.append(tensor_checksum(row))
                else:
                    checksums.append(None)
        return rows, checksums, time.perf_counter() - start

    def _encode(self, items: list[Prepared]) -> list[torch.Tensor]:
        """The model's rows for each item, in order: one forward of each modality's path for
        that modality's items (its images, its videos, its audio clips)."""
        by_path: dict[Callable[[list[Prepared]], list[torch.Tensor]], list[int]] = {}
        for index, item in enumerate(items):
            by_path.setdefault(self._features_of(item), []).append(index)
        if len(by_path) == 1:
            [features] = by_path
            return features(items)
        outs: list[torch.Tensor | None] = [None] * len(items)
        for features, indices in by_path.items():
            for index, out in zip(indices, features([items[i] for i in indices]), strict=True):
                outs[index] = out
        return [out for out in outs if out is not None]

    def _features_of(self, item: Prepared) -> Callable[[list[Prepared]], list[torch.Tensor]]:
        """The forward that encodes ``item``: its modality's path (the batch is one model's,
        so only the front's admission decides which paths occur)."""
        if isinstance(item, PreparedVideo):
            assert self.video is not None
            return cast(Callable[[list[Prepared]], list[torch.Tensor]], self.video.features)
        if isinstance(item, PreparedAudio):
            assert self.audio is not None
            return cast(Callable[[list[Prepared]], list[torch.Tensor]], self.audio.features)
        return self.model.encode

    async def _forward_in_thread(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn, limiter=self._forward_limiter)


def _wait_for(job: Job, request: _Wanted, index: int) -> None:
    job.waiters.append((request, index))
    request.jobs.add(job)
