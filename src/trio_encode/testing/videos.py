"""Small videos written with PyAV, for tests, the bench and the SGLang drive: frames whose
content moves from one to the next, so the codec has real work and no two frames are alike."""

from __future__ import annotations

import io
from collections.abc import Callable

import av
import numpy as np
import numpy.typing as npt

Frame = Callable[[int, int, int], npt.NDArray[np.uint8]]
"""``(index, width, height) -> (height, width, 3)`` RGB."""


def gradient(index: int, width: int, height: int) -> npt.NDArray[np.uint8]:
    """Diagonal gradients in each channel, shifted by ``index``."""
    ys, xs = np.mgrid[0:height, 0:width]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[..., 0] = (xs * 255 // max(width - 1, 1) + 9 * index) % 256
    out[..., 1] = (ys * 255 // max(height - 1, 1) + 5 * index) % 256
    out[..., 2] = ((xs + ys) * 3 + 17 * index) % 256
    return out


def write_video(
    count: int,
    rate: int,
    width: int = 80,
    height: int = 48,
    *,
    first: int = 0,
    frame: Frame = gradient,
    fmt: str = "mp4",
    codec: str = "libx264",
    gop: int | None = None,
    pix_fmt: str = "yuv420p",
    options: dict[str, str] | None = None,
) -> bytes:
    """``count`` frames (``frame(first)``, ``frame(first + 1)``...) at ``rate`` a second."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, options=options or {})
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if gop is not None:
            stream.codec_context.gop_size = gop
        for index in range(first, first + count):
            image = av.VideoFrame.from_ndarray(frame(index, width, height), format="rgb24")
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()
