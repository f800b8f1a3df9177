"""The vision encoder: image loading, the models, the front, the batcher and the caches.

The service uses :class:`ImageEncoder`; everything else is exposed for tests, benchmarks and
tools that save or load weights.
"""

from trio_encode.encoder.backend import (
    FixedShape,
    Prepared,
    VisionBackend,
    VisionModel,
    as_model,
    load_backend,
)
from trio_encode.encoder.batcher import ThreadRunner
from trio_encode.encoder.cache import CacheKey, EmbeddingCache, content_key
from trio_encode.encoder.front import EncoderInfo, ImageEncoder, arena_for
from trio_encode.encoder.images import Preprocess, decode_image, load_item
from trio_encode.encoder.observer import EncoderObserver, NullEncoderObserver
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.request_types import Grid

__all__ = [
    "CacheKey",
    "EmbeddingCache",
    "EncoderInfo",
    "EncoderObserver",
    "EncoderSettings",
    "FixedShape",
    "Grid",
    "ImageEncoder",
    "NullEncoderObserver",
    "Prepared",
    "Preprocess",
    "ThreadRunner",
    "VisionBackend",
    "VisionModel",
    "arena_for",
    "as_model",
    "content_key",
    "decode_image",
    "load_backend",
    "load_item",
]
