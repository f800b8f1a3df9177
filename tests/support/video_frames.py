"""Decoded frames without a codec between, and the digests recorded of what transformers'
video processors make of them, shared by the video path's tests."""

from __future__ import annotations

import hashlib
import platform

import numpy as np
import pytest
import torch

from trio_encode.encoder.video import DecodedVideo
from trio_encode.encoder.vlm_video import native_uint8_bilinear


def pattern(count: int, height: int, width: int) -> torch.Tensor:
    """``(count, 3, height, width)`` uint8 frames of fine, frame-dependent detail (no random
    generator: the same bytes with any library version), where resize filters differ."""
    t, c, y, x = np.meshgrid(
        np.arange(count), np.arange(3), np.arange(height), np.arange(width), indexing="ij"
    )
    values = (x * 37 + y * 91 + c * 53 + t * 11 + x * y) % 256
    return torch.from_numpy(values.astype(np.uint8))


SYNTHETIC = DecodedVideo(
    frames=pattern(6, 50, 90).permute(0, 2, 3, 1).contiguous().numpy(),
    indices=(0, 2, 4, 7, 9, 11),
    timestamps=(0.0, 0.5, 1.0, 1.75, 2.25, 2.75),
    total_frames=12,
    fps=4.0,
    codec="h264",
    width=90,
    height=50,
)
"""Six decoded frames as :func:`decode_video` would give them, without a codec between."""


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def recorded(digests: tuple[str, str]) -> str:
    """The digest recorded for this CPU: x86 with AVX2 or AVX-512, or without (others are
    not recorded: the test says so rather than guess). Recorded with torchvision 0.29.1
    (torch 2.14.1; the code under test gives the same with torch 2.13), on x86 CPUs with AVX2
    or AVX-512 and without either (``ATEN_CPU_CAPABILITY=default``), where some of torch's
    kernels round differently, and so does torchvision."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"digests are recorded on x86 CPUs only, not {platform.machine()}")
    return digests[0] if native_uint8_bilinear() else digests[1]
