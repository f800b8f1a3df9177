"""An encoder whose model loads in the background, so the server listens from its first second.

Loading a model takes seconds to minutes. Binding the port first means a port already in use
fails at once, before that wait, and that probes get an answer meanwhile: ``/livez`` says the
process lives, ``/readyz`` says 503 until the model is loaded and its warm-up forward has run,
and one "ready" log line says when that is, so an operator watching the log need not poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from trio_encode.arena import Arena
from trio_encode.errors import NotReady
from trio_encode.request_types import EmbeddingMemory
from trio_encode.server.metrics import QueueDepth
from trio_encode.service import Encoder

log = logging.getLogger(__name__)


class LoadingEncoder:
    """Stands in for the encoder ``load`` builds (blocking, in a worker thread) until it is
    built; calls meanwhile get :class:`NotReady`. A failing ``load`` fails the server.

    Loading begins at :meth:`start_loading`, which the caller calls once the port is bound: a
    server that cannot listen then exits without a loader thread to wait for.
    """

    def __init__(
        self, load: Callable[[], Encoder], *, arena: Arena | None = None, warmup: bool = True
    ) -> None:
        self._load = load
        self._warmup = warmup
        self._arena = arena
        self._encoder: Encoder | None = None
        self._may_load = trio.Event()

    @property
    def arena(self) -> Arena | None:
        """The arena the loaded encoder will write into: made before loading, so the service
        registers it at start, like any other."""
        return self._arena

    def start_loading(self) -> None:
        """Let :meth:`run` load the model (it waits for this)."""
        self._may_load.set()

    @property
    def ready(self) -> bool:
        return self._encoder is not None and self._encoder.ready

    @property
    def queued_images(self) -> int:
        """The loaded encoder's queue depth (0 while loading, or if it cannot tell)."""
        return self._encoder.queued_images if isinstance(self._encoder, QueueDepth) else 0

    def _loaded(self) -> Encoder:
        if self._encoder is None:
            raise NotReady("not ready: the model is still loading")
        return self._encoder

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        return await self._loaded().load_items(items, modality)

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> EmbeddingMemory:
        return await self._loaded().encode(images, modality)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start at once; once allowed, load the model, then run the loaded encoder until
        cancelled, logging one "ready" line when it serves (after its warm-up)."""
        task_status.started()
        await self._may_load.wait()
        started = trio.current_time()
        # A shutdown during loading waits for it: a thread abandoned in the middle of building
        # a model makes the interpreter abort at exit.
        try:
            encoder = await trio.to_thread.run_sync(self._load, abandon_on_cancel=False)
        except Exception as exc:
            # One line for the operator: the cause, not the loader's stack.
            raise RuntimeError(f"the model could not be loaded: {exc}") from exc
        log.info("model loaded in %.1f s", trio.current_time() - started)
        self._encoder = encoder
        async with trio.open_nursery() as nursery:
            # The encoder reports started once its warm-up forward has run: the first request
            # then pays no start-up cost, and /readyz answers 200 from here on.
            await nursery.start(encoder.run)
            how = "and warmed up" if self._warmup else "(no warm-up: the first request pays it)"
            log.info(
                "ready: model loaded %s in %.1f s (/readyz answers 200)",
                how,
                trio.current_time() - started,
            )
