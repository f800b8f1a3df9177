"""The bench's videos: H.264 MP4s written with PyAV, whose content moves from frame to frame
so that the codec has real work and no two sampled frames are alike."""

from __future__ import annotations

from trio_encode.testing.videos import write_video


def bench_video(
    seed: int = 0, seconds: int = 4, rate: int = 10, width: int = 320, height: int = 240
) -> bytes:
    """An MP4 of ``seconds`` at ``rate`` frames a second, ``width`` x ``height`` pixels, its
    content shifted by ``seed``."""
    return write_video(seconds * rate, rate, width, height, first=seed * 7919)


def bench_videos(count: int) -> list[bytes]:
    """``count`` distinct videos of the same size and length, one per concurrent caller: the
    encoder shares one forward among identical items in flight, so callers sending the same
    bytes would be served work that was never done."""
    return [bench_video(seed) for seed in range(count)]
