"""Helpers for tests that drive a model directly."""

from __future__ import annotations

import torch

from trio_encode.encoder import (
    EncoderSettings,
    FixedShape,
    ImageEncoder,
    VisionBackend,
    VisionModel,
)
from trio_encode.encoder.images import load_item


def fixed(model: VisionModel) -> VisionBackend:
    """The fixed-grid backend inside a loaded model (the built-in ViT, a CLIP/SigLIP tower)."""
    assert isinstance(model, FixedShape), model
    return model.backend


# A small built-in ViT the real-encoder HTTP tests serve (16 tokens of 256 floats an image).
SMALL = EncoderSettings(
    image_size=64,
    patch_size=16,
    width=64,
    depth=2,
    heads=2,
    hidden_size=256,
    max_batch_size=8,
    arena_bytes=0,  # the HTTP tests of per-request registration; test_http_arena sets its own
)
SMALL_ROW = 16 * 256 * 4
"""Bytes of one image's embedding with :data:`SMALL` (16 tokens of 256 floats)."""


def direct(encoder: ImageEncoder, uris: list[str]) -> torch.Tensor:
    """The embedding computed by the model directly, one image at a time, no server."""
    rows = []
    for data in [load_item(uri, max_bytes=SMALL.max_image_bytes) for uri in uris]:
        image = encoder.model.decode(data, max_pixels=SMALL.max_image_pixels)
        with torch.inference_mode():
            rows.append(encoder.model.encode([image])[0])
    return torch.cat(rows)
