"""Hostile videos: each small on the wire, each lying or costly where the decoder's limits
(the ``video_*`` settings) must catch it. Written with
:func:`~trio_encode.testing.videos.write_video` and PyAV, then edited byte by byte where a
header must lie:

- :func:`hours_webm`: 3 KB of 80x48 VP9 whose Segment Info says three hours.
- :func:`short_claiming_webm`: 32 KB whose Segment Info says one second, while its packets'
  timestamps span eleven minutes (one 16x16 frame a second).
- :func:`growing_ts`: 310 KB of MPEG-TS whose stream declares 64x48 frames and then carries
  640x480 ones (two streams back to back, a legal concatenation: the header is the first's).
- :func:`sample_table_bomb_mp4`: 3 KB of MP4 whose video (or audio) track's sample table
  declares 60 million samples of one size (20 bytes of ``stsz``); FFmpeg, opening it, indexes
  each one (2.4 GB and 2 to 3 s here) before any check of the server's could look at its
  header.
- :func:`fragment_bomb_mp4`: the same in a fragmented MP4, 20 bytes of its first fragment's
  run (``trun``) declaring 60 million samples (2.4 GB and 1 s to open).
- :func:`decode_bomb_ts`: 3 MB of MPEG-TS, one flat 1080p H.264 keyframe (1.2 KB) repeated
  2,400 times at 240 a second (10 s). Within every limit but the CPU budget: MPEG-TS has no
  index to seek by, so every frame up to the last chosen one is decoded (about 5 CPU seconds
  on one core here, for 20 chosen frames, 124 MB as RGB).

Built once per process and cached.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction
from functools import cache

import av
import numpy as np
import numpy.typing as npt

from trio_encode.testing.videos import Frame, write_video

BOMB_FRAMES = 2400
BOMB_RATE = 240


def webm_duration(data: bytes, milliseconds: float) -> bytes:
    """The WebM with its Segment Info's Duration (an 8-byte float) replaced."""
    at = data.index(b"\x44\x89\x88")
    return data[: at + 3] + struct.pack(">d", milliseconds) + data[at + 11 :]


@cache
def hours_webm() -> bytes:
    honest = write_video(20, 10, 80, 48, fmt="webm", codec="libvpx-vp9")
    return webm_duration(honest, 3 * 3600e3)


@cache
def short_claiming_webm() -> bytes:
    honest = write_video(661, 1, 16, 16, fmt="webm", codec="libvpx-vp9")
    return webm_duration(honest, 1000.0)


@cache
def growing_ts() -> bytes:
    return write_video(20, 10, 64, 48, fmt="mpegts") + write_video(60, 10, 640, 480, fmt="mpegts")


def _flat(shade: int) -> Frame:
    def frame(index: int, width: int, height: int) -> npt.NDArray[np.uint8]:
        return np.full((height, width, 3), shade, dtype=np.uint8)

    return frame


_MP4_PARENTS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl"})


def with_audio(fmt: str = "mp4") -> bytes:
    """20 frames of 16x16 H.264 at 10 a second and 10 AAC frames of silence beside them."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        video = container.add_stream("libx264", rate=10)
        assert isinstance(video, av.VideoStream)
        video.width = video.height = 16
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=48000)
        assert isinstance(audio, av.AudioStream)
        for _ in range(20):
            image = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            container.mux(video.encode(image))
        for index in range(10):
            sound = av.AudioFrame.from_ndarray(
                np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
            )
            sound.sample_rate, sound.pts = 48000, index * 1024
            container.mux(audio.encode(sound))
        container.mux(video.encode())
        container.mux(audio.encode())
    return out.getvalue()


@cache
def sample_table_bomb_mp4(
    samples: int = 60_000_000, fmt: str = "mp4", track: bytes = b"vide"
) -> bytes:
    """:func:`with_audio`, the sample tables (``stsz``, ``stsc``, ``stts``) of its ``track``
    (``vide`` or ``soun``) replaced by ones declaring ``samples`` samples of 100 bytes, 1,024
    ticks each, all in one chunk; every box holding them resized to fit."""
    tables = {
        b"stsz": struct.pack(">IIII", 20, 0, 100, samples),  # size, version/flags, size, count
        b"stsc": struct.pack(">IIIIII", 28, 0, 1, 1, samples, 1),  # chunk 1 holds them all
        b"stts": struct.pack(">IIIII", 24, 0, 1, samples, 1024),  # one run of them
    }

    def rebuilt(data: bytes, ours: bool = False) -> bytes:
        out = b""
        at = 0
        while at < len(data):
            size = struct.unpack_from(">I", data, at)[0]
            kind, body = data[at + 4 : at + 8], data[at + 8 : at + size]
            if kind == b"trak":
                handler = body.index(b"hdlr") + 12  # after its version, flags, pre_defined
                body = rebuilt(body, body[handler : handler + 4] == track)
                out += struct.pack(">I", len(body) + 8) + kind + body
            elif kind in _MP4_PARENTS:
                body = rebuilt(body, ours)
                out += struct.pack(">I", len(body) + 8) + kind + body
            elif ours and kind in tables:
                out += tables[kind][:4] + kind + tables[kind][4:]
            elif not (ours and kind in (b"stss", b"ctts")):  # they would disagree with ours
                out += data[at : at + size]
            at += size
        return out

    return rebuilt(with_audio(fmt))


def fragmented_mp4(frames: int = 20) -> bytes:
    """``frames`` of 16x16 H.264 at 10 a second in a fragmented MP4 (an empty ``moov``, then a
    ``moof`` and an ``mdat`` from each keyframe on)."""
    out = io.BytesIO()
    with av.open(
        out, "w", format="mp4", options={"movflags": "frag_keyframe+empty_moov"}
    ) as container:
        video = container.add_stream("libx264", rate=10, options={"g": "5"})
        assert isinstance(video, av.VideoStream)
        video.width = video.height = 16
        video.pix_fmt = "yuv420p"
        for index in range(frames):
            shade = np.full((16, 16, 3), index * 10 % 256, np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(shade, format="rgb24")))
        container.mux(video.encode())
    return out.getvalue()


@cache
def fragment_bomb_mp4(samples: int = 60_000_000) -> bytes:
    """:func:`fragmented_mp4` whose first fragment's run (``trun``) declares ``samples``
    samples of the default size, in 20 bytes; its ``traf`` and ``moof`` resized to fit."""
    data = bytearray(fragmented_mp4())
    at = data.index(b"trun") - 4
    size, _, flags = struct.unpack_from(">I4sI", data, at)
    assert flags & 1, "the run has a data offset"
    offset = struct.unpack_from(">i", data, at + 16)[0]
    run = struct.pack(">I4sIIi", 20, b"trun", 1, samples, offset)  # only the data offset
    data[at : at + size] = run
    for parent in (b"traf", b"moof"):
        start = data.rindex(parent, 0, at) - 4
        struct.pack_into(">I", data, start, struct.unpack_from(">I", data, start)[0] + 20 - size)
    return bytes(data)


@cache
def decode_bomb_ts(shade: int, frames: int = BOMB_FRAMES, rate: int = BOMB_RATE) -> bytes:
    """The bomb, its frames of grey ``shade`` (so bombs of different shades are different
    videos, which the server does not join)."""
    one = write_video(1, rate, 1920, 1080, frame=_flat(shade), fmt="mpegts")
    out = io.BytesIO()
    with av.open(io.BytesIO(one), mode="r", format="mpegts") as source:
        stream = source.streams.video[0]
        (packet,) = [packet for packet in source.demux(stream) if packet.size]
        payload = bytes(packet)
        with av.open(out, "w", format="mpegts") as container:
            copy = container.add_stream_from_template(stream)
            for index in range(frames):
                repeat = av.Packet(payload)
                repeat.stream = copy
                repeat.time_base = Fraction(1, rate)
                repeat.pts = repeat.dts = index
                repeat.is_keyframe = True
                container.mux(repeat)
    return out.getvalue()
