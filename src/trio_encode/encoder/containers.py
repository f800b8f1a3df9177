"""What the video and audio decoders share about opening a client's container with PyAV.

A client's bytes are opened only by the demuxer their magic names (FFmpeg's probing would try
its other demuxers, some of which open further files), FFmpeg's errors become
:class:`~trio_encode.errors.InvalidInput`, and a container's declared duration is read the
same way for both, before any packet is.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import av
import av.container
import av.stream

from trio_encode.errors import InvalidInput

MATROSKA_MAGIC = b"\x1a\x45\xdf\xa3"
"""The EBML header that opens a Matroska or WebM file."""


@contextmanager
def opened(data: bytes, container_format: str, noun: str) -> Iterator[av.container.InputContainer]:
    """The container over ``data`` opened by the ``container_format`` demuxer alone, with
    FFmpeg's errors as :class:`InvalidInput` naming the ``noun`` (``video``, ``audio``)."""
    try:
        with av.open(io.BytesIO(data), mode="r", format=container_format) as container:
            yield container
    except av.FFmpegError as exc:
        raise InvalidInput(f"the {noun} could not be decoded: {exc}") from None


def declared_seconds(
    container: av.container.InputContainer, stream: av.stream.Stream
) -> float | None:
    """The duration the stream, else the container, declares; None when neither does."""
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return float(container.duration / av.time_base)
    return None
