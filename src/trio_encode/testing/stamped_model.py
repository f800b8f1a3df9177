"""A drill's model: the real one, whose every embedding then names its image.

:class:`StampedModel` wraps any :class:`~trio_encode.encoder.VisionModel`: it strips an image's
identity trailer (:func:`trio_encode.testing.identity.tag`) before the real model decodes it,
runs the real forward (so a drill keeps the model's CPU time and memory), and then overwrites
each tagged image's embedding with its identity's words
(:func:`~trio_encode.testing.identity.words`). Images without a trailer keep the model's own
embedding. The cache, the arena, the store and the transfers see ordinary embeddings; only a
receiver knows how to read them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from trio_encode.encoder.backend import Prepared, VisionModel
from trio_encode.testing.identity import WORD, untag, words


@dataclass(frozen=True, eq=False)
class StampedPrepared(Prepared):
    identity: int | None = None


class StampedModel:
    """``model``, with every tagged image's embedding stamped with its identity."""

    def __init__(self, model: VisionModel) -> None:
        self.model = model
        self.model_id = f"{model.model_id}+identity-stamped"
        """Another model: its embeddings never share a cache or store key with the real
        one's."""
        self.hidden_size = model.hidden_size
        self.dtype = model.dtype
        self.device = model.device
        self.fixed_tokens = model.fixed_tokens

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.model.fingerprint}+identity-stamped".encode()).hexdigest()

    def decode(self, data: bytes, *, max_pixels: int) -> Prepared:
        image, identity = untag(data)
        prepared = self.model.decode(image, max_pixels=max_pixels)
        values = {f.name: getattr(prepared, f.name) for f in fields(Prepared)}
        return StampedPrepared(**values, identity=identity)

    def encode(self, images: Sequence[Prepared]) -> list[torch.Tensor]:
        out = self.model.encode(images)
        for image, embedding in zip(images, out, strict=True):
            identity = getattr(image, "identity", None)
            if identity is not None:
                stamp(embedding, identity)
        return out


def stamp(embedding: torch.Tensor, identity: int) -> None:
    """Overwrite a contiguous embedding, in place, with ``identity``'s words."""
    if not embedding.is_contiguous():
        raise ValueError("only a contiguous embedding can be stamped in place")
    raw = embedding.view(torch.uint8).reshape(-1)
    if raw.numel() % WORD:
        raise ValueError(f"an embedding of {raw.numel()} bytes is not a whole number of words")
    raw.copy_(torch.from_numpy(words(identity, raw.numel() // WORD).view("u1")).to(raw.device))
