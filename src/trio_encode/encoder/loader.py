"""The loader that picks the model the settings name: a model directory (transformers'
classes, :mod:`trio_encode.encoder.hf`) or the built-in ViT.

Apart from :mod:`trio_encode.encoder.backend`, so that the interface imports none of the models
that implement it (they import it)."""

from __future__ import annotations

import torch

from trio_encode.encoder.backend import FixedShape, VisionModel
from trio_encode.encoder.settings import EncoderSettings


def load_backend(settings: EncoderSettings) -> VisionModel:
    """The model the settings name. Blocking (reads weights): call it before serving or from a
    worker thread."""
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    if settings.model is not None:
        from trio_encode.encoder.hf import load_hf_model

        return load_hf_model(settings)
    if settings.device != "cpu":
        raise ValueError(
            f"device {settings.device}: the built-in ViT runs on the cpu only; serve a VLM "
            "directory (model) to run on a GPU"
        )
    from trio_encode.encoder.model import BuiltinBackend

    return FixedShape(BuiltinBackend(settings))
