"""The bench's videos: H.264 MP4s written with PyAV, whose content moves from frame to frame
so that the codec has real work and no two sampled frames are alike."""

from __future__ import annotations

import io

import av
import numpy as np
import numpy.typing as npt


def _frame(index: int, width: int, height: int) -> npt.NDArray[np.uint8]:
    """Diagonal gradients in each channel, shifted by ``index``."""
    ys, xs = np.mgrid[0:height, 0:width]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[..., 0] = (xs * 255 // max(width - 1, 1) + 9 * index) % 256
    out[..., 1] = (ys * 255 // max(height - 1, 1) + 5 * index) % 256
    out[..., 2] = ((xs + ys) * 3 + 17 * index) % 256
    return out


def bench_video(
    seed: int = 0, seconds: int = 4, rate: int = 10, width: int = 320, height: int = 240
) -> bytes:
    """An MP4 of ``seconds`` at ``rate`` frames a second, ``width`` x ``height`` pixels, its
    content shifted by ``seed``."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(seed * 7919, seed * 7919 + seconds * rate):
            image = av.VideoFrame.from_ndarray(_frame(index, width, height), format="rgb24")
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def bench_videos(count: int) -> list[bytes]:
    """``count`` distinct videos of the same size and length, one per concurrent caller: the
    encoder shares one forward among identical items in flight, so callers sending the same
    bytes would be served work that was never done."""
    return [bench_video(seed) for seed in range(count)]
