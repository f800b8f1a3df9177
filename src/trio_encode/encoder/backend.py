"""The interface every vision model is wrapped to.

The batcher knows only :class:`VisionModel`: an image's bytes become a :class:`Prepared` (the
model's own preprocessing, its token count and, for dynamic-resolution models, its grid), and a
batch of prepared images becomes one ``(tokens, hidden)`` tensor per image. Models with one
fixed grid (the built-in ViT, CLIP/SigLIP towers, tests' fakes) implement the simpler
:class:`VisionBackend` and are adapted by :class:`FixedShape`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from trio_encode.encoder.images import Preprocess, decode_image
from trio_encode.request_types import Grid

ItemMeta = tuple[tuple[str, float | list[float]], ...]
"""An item's metadata beside its rows, by name, in the order SGLang writes it."""


@dataclass(frozen=True, eq=False)
class Prepared:
    """One image as its model takes it, and what its embedding will be."""

    pixels: torch.Tensor
    """The model's input for this image alone (a square ``(3, S, S)``, or a model's own
    layout: Qwen-VL's ``(patches, C*T*P*P)``, InternVL's ``(tiles, 3, S, S)``)."""
    tokens: int
    """Rows of its embedding: the image tokens the model's processor puts in the prompt."""
    grid: Grid | None = None
    """Its grid, for the models whose prompt and positions need one (None: a fixed grid)."""
    size: tuple[int, int] | None = None
    """``(height, width)`` before preprocessing, for models whose features depend on it
    (LLaVA-OneVision's tiles and unpadding)."""

    @property
    def meta(self) -> ItemMeta:
        """What SGLang's prefill reads beside the rows, by name (a video's timestamps); an
        image has none."""
        return ()


@runtime_checkable
class VisionModel(Protocol):
    """A vision model as the batcher drives it: bytes in, per-image embeddings out."""

    model_id: str
    """Names the model and its weights; part of every cache key."""
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    """Where the forward runs; embeddings are copied to host memory from there."""
    fixed_tokens: int | None
    """Rows of every image's embedding when the model has one grid; None: per image."""

    @property
    def fingerprint(self) -> str:
        """Digest of the model's kind, configuration, dtype and weights, the same on every
        host (:mod:`trio_encode.encoder.fingerprint`); part of every key in the cluster-wide
        store."""
        ...

    def decode(self, data: bytes, *, max_pixels: int) -> Prepared:
        """Image bytes -> the prepared image. Raises :class:`~trio_encode.errors.InvalidInput`
        for bytes that are not a supported image. Blocking: called from a worker thread."""
        ...

    def encode(self, images: Sequence[Prepared]) -> list[torch.Tensor]:
        """One forward for ``images`` -> per image a contiguous ``(tokens, hidden_size)``
        tensor in ``dtype`` on ``device``. Blocking: called from the forward's thread."""
        ...


class VisionBackend(Protocol):
    """A model with one grid: normalised square pixels in, the same token count per image."""

    model_id: str
    fingerprint: str
    preprocess: Preprocess
    tokens_per_image: int
    hidden_size: int
    dtype: torch.dtype

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """float32 ``(B, 3, S, S)`` -> contiguous ``(B, tokens_per_image, hidden_size)`` in
        ``dtype``. Blocking and CPU-heavy: called from a worker thread."""
        ...


class FixedShape:
    """A :class:`VisionBackend` as a :class:`VisionModel` (on the CPU, one grid)."""

    def __init__(self, backend: VisionBackend) -> None:
        self.backend = backend
        self.model_id = backend.model_id
        self.hidden_size = backend.hidden_size
        self.dtype = backend.dtype
        self.device = torch.device("cpu")
        self.fixed_tokens: int | None = backend.tokens_per_image
        self.preprocess = backend.preprocess

    @property
    def fingerprint(self) -> str:
        return self.backend.fingerprint

    def decode(self, data: bytes, *, max_pixels: int) -> Prepared:
        pixels = decode_image(data, self.backend.preprocess, max_pixels=max_pixels)
        return Prepared(pixels, self.backend.tokens_per_image)

    def encode(self, images: Sequence[Prepared]) -> list[torch.Tensor]:
        out = self.backend.forward(torch.stack([image.pixels for image in images]))
        return list(out.unbind(0))


def as_model(backend: VisionModel | VisionBackend) -> VisionModel:
    """``backend`` as the batcher drives it (a fixed-grid backend is adapted)."""
    if isinstance(backend, VisionModel):
        return backend
    return FixedShape(backend)
