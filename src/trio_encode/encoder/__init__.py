"""The vision encoder: image loading, the models, the front, the batcher, the kept embeddings.

The service uses :class:`ImageEncoder`; everything else is exposed for tests, benchmarks and
tools that save or load weights.

The names below load their module on first use: the settings (:class:`EncoderSettings`, which
every command's options are made from) must not cost an import of torch, so that
``trio-encode --help`` and a mistyped flag answer at once.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trio_encode.encoder.backend import (
        FixedShape,
        Prepared,
        VisionBackend,
        VisionModel,
        as_model,
    )
    from trio_encode.encoder.cache import CacheKey, EmbeddingCache, content_key
    from trio_encode.encoder.front import EncoderInfo, ImageEncoder, arena_for
    from trio_encode.encoder.images import Preprocess, decode_image, load_item
    from trio_encode.encoder.keeping import ThreadRunner
    from trio_encode.encoder.loader import load_backend
    from trio_encode.encoder.observer import EncoderObserver, NullEncoderObserver
    from trio_encode.encoder.settings import EncoderSettings
    from trio_encode.request_types import Grid

_HOMES = {
    "CacheKey": "trio_encode.encoder.cache",
    "EmbeddingCache": "trio_encode.encoder.cache",
    "EncoderInfo": "trio_encode.encoder.front",
    "EncoderObserver": "trio_encode.encoder.observer",
    "EncoderSettings": "trio_encode.encoder.settings",
    "FixedShape": "trio_encode.encoder.backend",
    "Grid": "trio_encode.request_types",
    "ImageEncoder": "trio_encode.encoder.front",
    "NullEncoderObserver": "trio_encode.encoder.observer",
    "Prepared": "trio_encode.encoder.backend",
    "Preprocess": "trio_encode.encoder.images",
    "ThreadRunner": "trio_encode.encoder.keeping",
    "VisionBackend": "trio_encode.encoder.backend",
    "VisionModel": "trio_encode.encoder.backend",
    "arena_for": "trio_encode.encoder.front",
    "as_model": "trio_encode.encoder.backend",
    "content_key": "trio_encode.encoder.cache",
    "decode_image": "trio_encode.encoder.images",
    "load_backend": "trio_encode.encoder.loader",
    "load_item": "trio_encode.encoder.images",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


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
