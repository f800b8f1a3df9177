"""The encoder's front: one ``encode()`` per request, from image bytes to its embedding.

:class:`ImageEncoder` is what the service calls. It loads a request's items (fetching
``http(s)`` ones under the fetch rules), checks them against the per-request limits, reads each
item through the keeper (:mod:`trio_encode.encoder.keeping`: this encoder's arena or cache,
then the cluster-wide store), whatever its modality, by a key naming its modality and recipe
(:func:`key_recipe`), and hands what the keeper misses to the batcher
(:mod:`trio_encode.encoder.batcher`), which runs one forward pass for many requests and admits
or refuses the images (a full queue is :class:`Overloaded`). The keeper then makes the
request's embedding of the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import trio

from trio_encode.arena import Arena
from trio_encode.embedding import DTYPE_NAMES, TORCH_DTYPES, Embedding, RowsEmbedding
from trio_encode.encoder.audio import AUDIO_ITEMS
from trio_encode.encoder.backend import FixedShape, VisionBackend, VisionModel, as_model
from trio_encode.encoder.batcher import Batcher
from trio_encode.encoder.cache import CacheKey, EmbeddingCache, content_key
from trio_encode.encoder.fetch import FetchPolicy, RemoteFetcher, is_remote
from trio_encode.encoder.fingerprint import recipe_digest
from trio_encode.encoder.images import ImageTooBig, MediaKind, image_pixels, load_item
from trio_encode.encoder.keeping import (
    EmbeddingKeeper,
    ThreadRunner,
    release,
    worker_threads,
)
from trio_encode.encoder.loader import load_backend
from trio_encode.encoder.observer import EncoderObserver, NullEncoderObserver
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.store import EmbeddingStore
from trio_encode.encoder.video import VIDEO_ITEMS, FrameSampling
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.encoder.vlm_audio import AudioPath
from trio_encode.encoder.vlm_video import VideoPath
from trio_encode.errors import InvalidInput


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
        video: VideoPath | None = None,
        audio: AudioPath | None = None,
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
        if arena is not None and self.model.device.type == "cuda":
            pin_for_cuda(arena)
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
        self.in_worker_thread: ThreadRunner = run_decode or worker_threads(2)
        """Runs a request's blocking work other than the forward (loading, decoding, hashing,
        copies) in the worker threads (``run_decode``: another runner, for tests)."""
        self.keeper = EmbeddingKeeper(
            model,
            cache_bytes=self.settings.cache_bytes,
            arena=arena,
            store=store,
            observer=self.observer,
            in_worker_thread=self.in_worker_thread,
        )
        """Where embeddings are kept and found again: locally, then in the store."""
        self.batcher = Batcher(
            model,
            self.settings,
            observer=self.observer,
            keeper=self.keeper,
            in_worker_thread=self.in_worker_thread,
            run_forward=run_forward,
            video=video if video is not None else video_path_for(backend, self.settings),
            audio=audio if audio is not None else audio_path_for(backend, self.settings),
            images=takes_images(backend),
            run_media_decode=run_decode,
        )
        """Queues the items no forward is computing yet and runs them in batches."""
        video, audio = self.batcher.video, self.batcher.audio
        paths = {"IMAGE": takes_images(backend), "VIDEO": video, "AUDIO": audio}
        self.modalities = frozenset(name for name, path in paths.items() if path)
        """SGLang's modalities this encoder serves (``VIDEO``, ``AUDIO``: with the model's
        path for it)."""
        self.recipes = {
            modality: key_recipe(modality, video, audio) for modality in self.modalities
        }
        """Each served modality's recipe, part of every key of its items."""

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
        """The plain-memory cache (None with an arena, which is the cache then)."""
        return self.keeper.cache

    @property
    def arena(self) -> Arena | None:
        """Where embeddings are written (and cached); None: ordinary memory."""
        return self.keeper.arena

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

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        """The encoded bytes of each ``mm_items`` entry, without decoding pixels. ``http(s)``
        items are fetched (under the fetch rules), the rest loaded off the event loop (base64
        of MBs, file reads). Raises :class:`InvalidInput` naming the entry.

        Every per-request limit is checked before the work it bounds: the item count before
        anything is loaded; the bytes as each item is read or fetched (an item only gets what
        is left of ``max_request_bytes``); an image's pixels from its header, before any
        decode (a video's limits are checked from its container's header when it is decoded).
        An entry repeated in one request is loaded once."""
        self._check_modality(modality)
        self._check_image_count(len(items))
        if modality != "IMAGE":
            return await self._load_media(items, MEDIA_ITEMS[modality])
        limits = self.settings
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
                    pixels += await self.in_worker_thread(partial(self._pixels, data))
                else:
                    data, more = await self.in_worker_thread(
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

    async def _load_media(self, items: Sequence[str], kind: MediaKind) -> list[bytes]:
        """Each video's or audio clip's bytes, within what is left of ``max_request_bytes`` (a
        fetched one also within the fetch rules' bytes); their limits are checked from their
        containers' headers when they are decoded."""
        loaded: dict[str, bytes] = {}
        bytes_left = self.settings.max_request_bytes
        for index, item in enumerate(items):
            if item in loaded:
                continue
            try:
                if is_remote(item):
                    data = await self._fetcher.fetch(item, max_bytes=bytes_left)
                else:
                    data = await self.in_worker_thread(
                        partial(
                            load_item,
                            item,
                            max_bytes=bytes_left,
                            media_dir=self.settings.media_dir,
                            kind=kind,
                        )
                    )
            except InvalidInput as exc:  # too big: the message names what was left
                raise InvalidInput(f"mm_items[{index}]: {exc.message}") from None
            bytes_left -= len(data)
            loaded[item] = data
        return [loaded[item] for item in items]

    def _check_modality(self, modality: str) -> None:
        if modality not in self.modalities:
            served = ", ".join(sorted(self.modalities))
            raise InvalidInput(
                f"modality {modality!r} is not served by this model (it serves {served})"
            )

    def _load_local(self, item: str, max_bytes: int) -> tuple[bytes, int]:
        """In a worker thread: a local item's bytes and its pixel count (from its header)."""
        data = load_item(item, max_bytes=max_bytes, media_dir=self.settings.media_dir)
        return data, self._pixels(data)

    def _pixels(self, data: bytes) -> int:
        return image_pixels(data, max_pixels=self.settings.max_image_pixels)

    async def encode(
        self, items: Sequence[bytes], modality: str = "IMAGE"
    ) -> Embedding | RowsEmbedding:
        """The embedding of a request's images: ``(images * tokens, hidden)`` rows in order.

        Each image is looked up where embeddings are kept (locally, then in the store); only
        what misses goes to the batcher. Raises :class:`InvalidInput` (an image cannot be
        decoded), :class:`Overloaded` (the queue is full), :class:`NotReady` (the encoder is
        not running yet), :class:`EncodeFailed` (the model raised) or :class:`ShuttingDown`
        (the encoder stopped).
        """
        if not self.batcher.running:
            raise self.batcher.refusal()
        self._check_modality(modality)
        self._check_image_count(len(items))
        keys = await self.in_worker_thread(
            partial(content_keys, self.model.model_id, modality, self.recipes[modality], items)
        )
        rows = await self.keeper.find(keys, self.batcher.in_flight)
        handed_over = False
        try:
            missing = [index for index, kept in enumerate(rows) if kept is None]
            if missing:
                await self.batcher.encode(items, keys, missing, rows, modality=modality)
            found = [kept for kept in rows if kept is not None]
            embedding = await self.keeper.embedding(found, modality)
            handed_over = True  # the arena leases of the rows that lie there are its now
            return embedding
        finally:
            if not handed_over:
                release(rows)

    def _check_image_count(self, count: int) -> None:
        """A request names at least one image and at most ``queue_size``."""
        if count == 0:
            raise InvalidInput("mm_items is empty: send at least one image")
        if count > self.settings.queue_size:
            raise InvalidInput(
                f"{count} images in one request; this server accepts at most "
                f"{self.settings.queue_size}"
            )


def video_path_for(model: object, settings: EncoderSettings) -> VideoPath | None:
    """The video path of a VLM served from ``settings.model`` that has one, sampling frames by
    the settings; None for any other model."""
    if not isinstance(model, VLMVisionModel) or settings.model is None:
        return None
    sampling = FrameSampling(
        settings.video_fps, settings.video_min_frames, settings.video_max_frames
    )
    return VideoPath.for_model(model, settings.model, sampling)


def takes_images(model: object) -> bool:
    """Whether the model encodes images (an audio model's family does not)."""
    return not isinstance(model, VLMVisionModel) or model.family.images


def audio_path_for(model: object, settings: EncoderSettings) -> AudioPath | None:
    """The audio path of a model served from ``settings.model`` that has one; None for any
    other model."""
    if not isinstance(model, VLMVisionModel) or settings.model is None:
        return None
    return AudioPath.for_model(model, settings.model)


MEDIA_ITEMS = {"VIDEO": VIDEO_ITEMS, "AUDIO": AUDIO_ITEMS}
"""What each modality's items other than images may be (media types, file suffixes)."""


def key_recipe(modality: str, video: VideoPath | None, audio: AudioPath | None = None) -> str:
    """The recipe in the keys of a modality's items: a digest of what turns their bytes into
    the model's input beyond the model (whose fingerprint is in every store key already). For
    a video, its path's recipe (the frame sampling, the family's resize and processor
    settings): the same bytes sampled or resized otherwise are other rows, never to share an
    entry; for an audio clip, its path's (the rate it is resampled to, the extractor's
    padding). Empty for an image (its preprocessing is the model's)."""
    if modality == "VIDEO" and video is not None:
        return recipe_digest(video.recipe)
    if modality == "AUDIO" and audio is not None:
        return recipe_digest(audio.recipe)
    return ""


def content_keys(
    model_id: str, modality: str, recipe: str, items: Sequence[bytes]
) -> list[CacheKey]:
    """In a worker thread: each item's key (it hashes every byte)."""
    return [content_key(model_id, data, modality, recipe) for data in items]


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
