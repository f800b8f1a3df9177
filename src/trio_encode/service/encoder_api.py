"""The encoder as the service uses it: what ``trio_encode.encoder`` provides, and what test
doubles and drills wrap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import trio

from trio_encode.arena import Arena
from trio_encode.request_types import EmbeddingMemory


class Encoder(Protocol):
    """The encoder as the service uses it (``trio_encode.encoder`` provides the real one)."""

    @property
    def ready(self) -> bool: ...

    @property
    def arena(self) -> Arena | None:
        """The registered arena the encoder writes embeddings into; None: per-request
        registration only."""
        ...

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        """Check and load ``mm_items`` (at least one) without decoding pixels; raise
        InvalidInput."""
        ...

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> EmbeddingMemory:
        """The embedding of ``images``; its ``checksum`` already computed off the event loop
        when that is costly (the real encoder does it in its worker thread)."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The encoder's long-lived work (batching), run in the service nursery."""
        ...


class PassThroughEncoder:
    """Passes every call to ``inner``: the base of wrappers that change only some calls."""

    def __init__(self, inner: Encoder) -> None:
        self._inner = inner

    @property
    def ready(self) -> bool:
        return self._inner.ready

    @property
    def arena(self) -> Arena | None:
        return self._inner.arena

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        return await self._inner.load_items(items, modality)

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> EmbeddingMemory:
        return await self._inner.encode(images, modality)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._inner.run(task_status=task_status)
