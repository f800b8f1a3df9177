"""Audio clips for tests, benchmarks and drills, written by PyAV (the library the server
decodes them with): a tone of known pitch, or given samples, in any of :data:`FORMATS`."""

from __future__ import annotations

import io
from typing import Any

import av
import numpy as np
import numpy.typing as npt

PITCH = 440.0
"""Hz of :func:`tone` unless another is asked for."""


def tone(
    rate: int, seconds: float, channels: int = 1, pitch: float = PITCH
) -> npt.NDArray[np.float32]:
    """``(channels, samples)`` of a sine at ``pitch`` Hz, half scale; channel ``c`` is
    multiplied by ``(-1) ** c``."""
    t = np.arange(round(rate * seconds)) / rate
    wave = 0.5 * np.sin(2 * np.pi * pitch * t)
    return np.stack([wave * (-1) ** c for c in range(channels)]).astype(np.float32)


FORMATS = {
    # name: (container, encoder, sample format it takes, container options)
    "wav": ("wav", "pcm_s16le", "s16", {}),
    "flac": ("flac", "flac", "s16", {}),
    "mp3": ("mp3", "libmp3lame", "fltp", {}),
    "mp3-bare": ("mp3", "libmp3lame", "fltp", {"id3v2_version": "0", "write_xing": "0"}),
    "m4a": ("ipod", "aac", "fltp", {}),
    "webm": ("webm", "libopus", "s16", {}),
    "ogg": ("ogg", "libopus", "s16", {}),
}
"""The clips written here; ``mp3-bare`` has no ID3 tag and no Xing header: it opens with a
frame."""


def write(
    name: str,
    rate: int,
    seconds: float = 0.0,
    channels: int = 1,
    samples: npt.NDArray[np.float32] | None = None,
) -> bytes:
    """A clip in format ``name`` of :data:`FORMATS`: ``samples`` (``(channels, n)`` floats in
    [-1, 1]) or a :func:`tone` of ``seconds``."""
    container_format, codec, sample_format, options = FORMATS[name]
    if samples is None:
        samples = tone(rate, seconds, channels)
    channels = samples.shape[0]
    layout = "mono" if channels == 1 else "stereo"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format, options=options) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        assert isinstance(stream, av.AudioStream)
        planes: npt.NDArray[Any]
        if sample_format == "s16":
            planes = np.round(samples * 32767).astype(np.int16).T.reshape(1, -1)
        else:
            planes = samples
        frame = av.AudioFrame.from_ndarray(planes, format=sample_format, layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()
