"""A stand-in vision backend for the transfer rows: an output of an exact size, at once.

The transfer rows measure ``/send``; what fills the embedding does not matter to them, but its
size does, and running the real model for each of 25.6 MB of rows would only slow the untimed
encoding. This backend answers ``tokens`` rows of 2048 floats per image, each image's rows
derived from its pixels (so distinct images give distinct bytes to verify).
"""

from __future__ import annotations

import torch

from trio_encode.encoder.images import Preprocess

HIDDEN = 2048
ROW_BYTES = HIDDEN * 4


def tokens_for(nbytes: int) -> int:
    """Rows of 2048 float32 closest to ``nbytes`` (at least one)."""
    return max(1, round(nbytes / ROW_BYTES))


class SizedBackend:
    """``(B, tokens, 2048)`` float32 per batch; cheap, deterministic, distinct per image."""

    dtype = torch.float32
    hidden_size = HIDDEN

    def __init__(self, tokens: int, image_size: int = 16) -> None:
        self.tokens_per_image = tokens
        self.preprocess = Preprocess(image_size=image_size)
        self.model_id = f"sized(tokens={tokens})"
        self.fingerprint = self.model_id  # no weights: the shape is the whole model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        seeds = pixels.flatten(1)[:, :HIDDEN]
        row = torch.zeros(pixels.shape[0], 1, HIDDEN)
        row[:, 0, : seeds.shape[1]] = seeds
        return (row + torch.arange(self.tokens_per_image).view(1, -1, 1)).contiguous()
