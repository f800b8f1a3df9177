"""Helpers for tests that drive a model directly."""

from __future__ import annotations

from trio_encode.encoder import FixedShape, VisionBackend, VisionModel


def fixed(model: VisionModel) -> VisionBackend:
    """The fixed-grid backend inside a loaded model (the built-in ViT, a CLIP/SigLIP tower)."""
    assert isinstance(model, FixedShape), model
    return model.backend
