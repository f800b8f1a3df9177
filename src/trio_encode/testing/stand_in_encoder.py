"""A small deterministic stand-in for the vision encoder.

The embedding of an image is a pure function of its bytes (:func:`expected_embedding`), so a
test can compute what every receiver must hold without asking the server. Images whose bytes
start with ``SLOW`` take ``slow_seconds`` to encode, those starting with ``FAIL`` make the
encoder raise, and those starting with ``BAD`` are undecodable (found only when encoding, as a
real encoder finds a corrupt image), so tests can steer timing and failures through the request
body alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence

import torch
import trio

from trio_encode.embedding import Embedding
from trio_encode.errors import InvalidInput

ROWS_PER_IMAGE = 64
DIM = 512


def expected_embedding(images: Sequence[bytes]) -> torch.Tensor:
    """What the stand-in returns for ``images``: seeded by each image's SHA-256."""
    parts = []
    for image in images:
        seed = int.from_bytes(hashlib.sha256(image).digest()[:8], "little")
        generator = torch.Generator().manual_seed(seed)
        parts.append(torch.randn(ROWS_PER_IMAGE, DIM, generator=generator))
    return torch.cat(parts).contiguous()


def embedding_size(images: int) -> int:
    return images * ROWS_PER_IMAGE * DIM * 4


class StandInEncoder:
    """Implements the service's ``Encoder`` protocol without a model."""

    arena = None  # per-request registration only

    def __init__(self, *, delay: float = 0.0, slow_seconds: float = 5.0) -> None:
        self.delay = delay
        self.slow_seconds = slow_seconds
        self.runs = 0
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        await trio.lowlevel.checkpoint()
        images = []
        for index, item in enumerate(items):
            header, comma, payload = item.partition(",")
            if not comma or not header.startswith("data:image/") or ";base64" not in header:
                raise InvalidInput(f"mm_items[{index}]: not a data:image/...;base64, URI")
            try:
                images.append(base64.b64decode(payload, validate=True))
            except binascii.Error:
                raise InvalidInput(f"mm_items[{index}]: the base64 data is corrupt") from None
        return images

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
        self.runs += 1
        if self.delay:
            await trio.sleep(self.delay)
        if any(image.startswith(b"SLOW") for image in images):
            await trio.sleep(self.slow_seconds)
        if any(image.startswith(b"FAIL") for image in images):
            raise RuntimeError("stand-in encoder told to fail")
        for index, image in enumerate(images):
            if image.startswith(b"BAD"):
                raise InvalidInput(f"mm_items[{index}]: cannot decode the image")
        return Embedding(expected_embedding(images), (None,) * len(images))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ready = True
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._ready = False
