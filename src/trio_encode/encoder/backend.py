"""The forward interface every vision model is wrapped to, and the loader that picks one.

The batcher knows only this interface, so the built-in ViT, a Hugging Face tower and a test's
fake model are interchangeable.
"""

from __future__ import annotations

from typing import Protocol

import torch

from trio_encode.encoder.images import Preprocess
from trio_encode.encoder.settings import EncoderSettings


class VisionBackend(Protocol):
    """A vision model: normalised pixels in, per-image token embeddings out."""

    model_id: str
    """Names the model and its weights; part of every cache key."""
    fingerprint: str
    """Digest of the model's kind, configuration, dtype and weights, the same on every host
    (:mod:`trio_encode.encoder.fingerprint`); part of every key in the cluster-wide store."""
    preprocess: Preprocess
    tokens_per_image: int
    hidden_size: int
    dtype: torch.dtype

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """float32 ``(B, 3, S, S)`` -> contiguous ``(B, tokens_per_image, hidden_size)`` in
        ``dtype``. Blocking and CPU-heavy: called from a worker thread."""
        ...


def load_backend(settings: EncoderSettings) -> VisionBackend:
    """The model the settings name. Blocking (reads weights): call it before serving or from a
    worker thread."""
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    if settings.hf_model_dir is not None:
        from trio_encode.encoder.hf import HFVisionBackend

        return HFVisionBackend(settings)
    from trio_encode.encoder.model import BuiltinBackend

    return BuiltinBackend(settings)
